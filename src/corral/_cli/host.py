"""Host and service commands: ``doctor``, ``reap``, ``metrics``, ``demo`` and ``serve``. Each
imports what it runs (the HTTP service) when it runs."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

from .common import EXIT_FAILED, EXIT_UNAVAILABLE, emit_json, handle_errors, home_of, json_option

if TYPE_CHECKING:
    from .._settings import Settings

__all__ = ["demo", "doctor", "metrics", "reap", "serve"]


@click.command()
@json_option
@click.pass_context
@handle_errors
def metrics(ctx: click.Context, as_json: bool) -> None:
    """Print Prometheus metrics (text exposition format): sandboxes, commands, reaper.

    --json: a list of {name, type, help, samples: [{name, labels, value}]}, one per metric.
    """
    from .._audit.metrics import render
    from .._control.plane import get_manager

    text = render(get_manager(ctx.obj["settings"]).store)
    if not as_json:
        click.echo(text, nl=False)
        return
    from prometheus_client.parser import text_string_to_metric_families

    emit_json([{"name": family.name, "type": family.type, "help": family.documentation,
                "samples": [{"name": s.name, "labels": s.labels, "value": s.value}
                            for s in family.samples]}
               for family in text_string_to_metric_families(text)])


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; beyond loopback, API keys are required.")
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--host-name", "host_names", multiple=True, metavar="NAME",
              help="Another name (host or host:port) the service answers to, besides the "
                   "listen address, localhost, 127.0.0.1 and [::1]; repeatable "
                   "(CORRAL_SERVER_HOST_NAMES, comma-separated). Requests with any other Host "
                   "get 421; browser pages from any other origin get 403.")
@click.option("--allow-keyless", is_flag=True, default=None,
              help="Serve keyless on loopback even though API keys existed and all are now "
                   "revoked. Dangerous: any local process, and any web page that reaches "
                   "loopback, can then run code here; without it the service keeps asking for "
                   "a key (CORRAL_SERVER_ALLOW_KEYLESS).")
@click.option("--e2b-port", type=click.IntRange(1, 65535), default=None,
              help="Also serve the E2B dialect on this port (same address): the official E2B "
                   "SDKs work with E2B_API_URL and E2B_SANDBOX_URL set to http://HOST:PORT and "
                   "a key from `corral keys create TENANT --e2b`.")
@click.option("--e2b-domain", default=None, metavar="DOMAIN",
              help="E2B domain mode: answer api.DOMAIN and <port>-<sandbox>.DOMAIN (for SDKs "
                   "that only know E2B_DOMAIN); needs --e2b-tls-cert and --e2b-tls-key.")
@click.option("--e2b-tls-cert", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM certificate (chain) for api.DOMAIN and *.DOMAIN.")
@click.option("--e2b-tls-key", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM private key of --e2b-tls-cert.")
@click.option("--e2b-tls-local", is_flag=True, default=False,
              help="Serve the E2B listener over TLS with a certificate Corral makes for this "
                   "address, signed by a CA of the data directory's own: clients set "
                   "SSL_CERT_FILE=$CORRAL_HOME/e2b-tls/bundle.pem and E2B_API_URL="
                   "E2B_SANDBOX_URL=https://HOST:PORT, and every SDK release works, the code "
                   "interpreters < 2.9 that frameworks pin included.")
@click.option("--ports-url", default=None, metavar="URL",
              help="The URL clients reach this service at, for the URLs of exposed ports "
                   "(default: the one each request came in on; CORRAL_PORTS_URL).")
@click.option("--ports-domain", default=None, metavar="DOMAIN",
              help="A wildcard DNS domain pointing here: exposed ports are also served at "
                   "<port>-<sandbox>.DOMAIN, E2B's form (CORRAL_PORTS_DOMAIN).")
@click.option("--cluster", "cluster", default=None, metavar="ADDRESS",
              help="Serve a Ray cluster of Corral nodes (HEAD:6379) instead of this host: "
                   "each sandbox is placed on a node and its calls relayed there. Needs Ray "
                   "token authentication (RAY_AUTH_MODE=token); see docs/cluster.md.")
@click.option("--share-home", is_flag=True,
              help="Start even if another Corral instance (corral serve, corral mcp) uses the "
                   "data directory: both then reap and recover the same sandboxes.")
@click.option("--check-config", is_flag=True,
              help="Check the configuration (settings, data directory, keys for a non-loopback "
                   "address, names, E2B and TLS options, the default tier's host checks, free "
                   "ports) and exit: 0 when `corral serve` with the same options would start, "
                   "2 with every problem found. The systemd unit runs it before starting.")
@click.pass_context
@handle_errors
def serve(ctx: click.Context, host: str, port: int, host_names: tuple[str, ...],
          allow_keyless: bool | None, e2b_port: int | None, e2b_domain: str | None,
          e2b_tls_cert: str | None, e2b_tls_key: str | None, e2b_tls_local: bool,
          ports_url: str | None, ports_domain: str | None, cluster: str | None,
          share_home: bool, check_config: bool) -> None:
    """Run the HTTP API (OpenAPI at /docs and /openapi.json, Prometheus at /metrics), and with
    --e2b-port the E2B dialect beside it; with --cluster, over a Ray cluster."""
    from .._control.plane import get_manager
    from .._serve.run import E2BListener
    from .._serve.run import serve as run_server

    settings: Settings = ctx.obj["settings"]
    if e2b_tls_local:
        from ..errors import UsageError

        if e2b_tls_cert or e2b_tls_key or e2b_domain or cluster:
            raise UsageError("--e2b-tls-local makes the listener's certificate itself: leave "
                             "out --e2b-tls-cert, --e2b-tls-key, --e2b-domain and --cluster")
        if e2b_port is None:
            raise UsageError("--e2b-tls-local needs --e2b-port")
        from .._e2b.localtls import ensure_local_tls

        tls = ensure_local_tls(settings.home / "e2b-tls", host)
        e2b_tls_cert, e2b_tls_key = str(tls.cert), str(tls.key)
        click.echo(f"corral: the E2B listener speaks TLS; clients set SSL_CERT_FILE={tls.bundle} "
                   f"and E2B_API_URL=E2B_SANDBOX_URL=https://{host}:{e2b_port}", err=True)
    if cluster is not None:
        from ..errors import UsageError

        if check_config:
            raise UsageError("--check-config checks one host's service; a cluster's nodes "
                             "each check their own (`corral serve --check-config` on each)")
        if ports_url is not None or ports_domain is not None:
            raise UsageError("--cluster serves exposed ports in the path form "
                             "(/ports/SANDBOX/PORT/), and E2B's <port>-<sandbox>.DOMAIN with "
                             "--e2b-domain: --ports-url and --ports-domain are not available "
                             "with it yet")
        if e2b_port is None and (e2b_domain or e2b_tls_cert or e2b_tls_key):
            raise UsageError("--e2b-domain and --e2b-tls-* need --e2b-port")
        from .._cluster.serve import serve_cluster

        serve_cluster(cluster, settings, host=host, port=port,
                      host_names=[*settings.server_host_names.split(","), *host_names],
                      allow_keyless=settings.server_allow_keyless if allow_keyless is None
                      else allow_keyless, e2b_port=e2b_port, e2b_domain=e2b_domain,
                      e2b_tls_cert=e2b_tls_cert, e2b_tls_key=e2b_tls_key)
        return
    if ports_url is not None or ports_domain is not None:
        from pydantic import ValidationError

        from .._settings import Settings as Checked

        # Validated as the settings are: a malformed URL or domain is refused here.
        try:
            settings = Checked.model_validate({
                **settings.model_dump(), **({"ports_url": ports_url} if ports_url else {}),
                **({"ports_domain": ports_domain} if ports_domain else {})})
        except ValidationError as exc:
            problem = exc.errors()[0]
            raise click.BadParameter(
                f"{problem['input']!r} is not a valid {problem['loc'][0]} (an http(s)://host"
                "[:port] URL, or a DNS domain like ports.example.internal)") from None
    names = [*settings.server_host_names.split(","), *host_names]
    e2b = None
    if e2b_port is not None:
        e2b = E2BListener(port=e2b_port, domain=e2b_domain, tls_cert=e2b_tls_cert,
                          tls_key=e2b_tls_key, templates=settings.e2b_templates)
    elif e2b_domain or e2b_tls_cert or e2b_tls_key:
        from ..errors import UsageError

        raise UsageError("--e2b-domain and --e2b-tls-* need --e2b-port")
    keyless = settings.server_allow_keyless if allow_keyless is None else allow_keyless
    if check_config:
        from .preflight import check_service

        check_service(settings, host=host, ports=[port, *([e2b_port] if e2b_port else [])],
                      host_names=names, allow_keyless=keyless, e2b=e2b, share_home=share_home)
        return
    run_server(get_manager(settings), host=host, port=port, host_names=names,
               allow_keyless=keyless, e2b=e2b, share_home=share_home)


@click.command()
@json_option
@click.pass_context
@handle_errors
def reap(ctx: click.Context, as_json: bool) -> None:
    """Destroy expired sandboxes and clean what crashed processes left behind.

    Every command does this on start for the sandboxes and pieces it can reach without loading
    another tier (processes, cgroups, network namespaces and workspaces of every tier); this
    also sweeps each tier's own leftovers (gVisor's runsc state, microVM keepers and disks), as
    the service's reaper does. Run it from cron or a systemd timer so expired sandboxes are
    removed even when nothing else runs.
    """
    from .._control.plane import get_manager

    removed = get_manager(ctx.obj["settings"]).recover()
    if as_json:
        emit_json({"removed": removed})
    else:
        for item in removed:
            click.echo(f"removed {item}")
        click.echo(f"{len(removed)} item(s) removed", err=True)


@click.command()
@json_option
@click.pass_context
@handle_errors
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check which isolation tiers this host can run safely, and say how to fix what is missing.

    Exits 0 when the default tier (``CORRAL_BACKEND``) can run; the other tiers are reported,
    with their reasons, either way. ``--json``: ``{ok, default, checks, tiers: {name:
    {supported, remembered, checks}}}``, where ``checks`` are the default tier's.

    Every check runs now. Other commands reuse a tier's passing checks for the rest of this
    boot, until a program they vetted or Corral changes (``remembered``); this run replaces
    what was remembered, or forgets it when a check fails.
    """
    from .._backends._linux.hostcheck import checks_path
    from .tiers import check_lines, echo_tiers, tier_checks

    settings = ctx.obj["settings"]
    tiers = tier_checks(settings)
    supported = {name: all(c.ok for c in checks) for name, checks in tiers.items()}
    remembered = {name: checks_path(settings, name).is_file() for name in tiers}
    ok = supported[settings.backend]
    hibernation = _hibernation(supported)
    if as_json:
        emit_json({"ok": ok, "default": settings.backend, "hibernation": hibernation,
                   "checks": check_lines(tiers[settings.backend]),
                   "tiers": {name: {"supported": supported[name],
                                    "remembered": remembered[name],
                                    "checks": check_lines(checks)}
                             for name, checks in tiers.items()}})
    else:
        echo_tiers(tiers, settings.backend)
        click.echo(f"hibernation: {hibernation['summary']}")
        kept = [name for name, good in remembered.items() if good]
        if kept:
            click.echo(f"checks remembered for this boot ({', '.join(kept)}): other commands "
                       "skip them until a program they vetted, the kernel or Corral changes; "
                       "`corral doctor` always checks again", err=True)
    sys.exit(0 if ok else EXIT_UNAVAILABLE)


def _hibernation(supported: Mapping[str, bool]) -> dict[str, Any]:
    """What a hibernate can keep here: files (and /tmp) on the tiers this host runs; a
    process's memory on the microVM tier's. CRIU, if installed, is asked whether it could work
    on this kernel (``criu check``), so the report says what stands in the way of the
    namespace tier's."""
    import shutil

    tiers = [name for name in ("namespace", "gvisor", "microvm") if supported.get(name)]
    criu = shutil.which("criu")
    criu_check = None if criu is None else _criu_check(criu)
    if criu is None:
        criu_said = "criu is not installed"
    elif criu_check is None:
        criu_said = f"criu at {criu} passes `criu check` but Corral does not use it yet"
    else:
        criu_said = f"criu at {criu} fails `criu check` on this kernel: {criu_check}"
    kept = [name for name in tiers if name == "microvm"]
    summary = (
        (f"a sandbox with no process running hibernates on {', '.join(tiers)} (nothing of it "
         "left in the kernel; its files and /tmp on disk)" if tiers else
         "no tier here can hibernate a sandbox")
        + (f"; on {', '.join(kept)} its running processes' memory is saved too, and they go "
           "on after the wake" if kept else "")
        + "; on the namespace and gvisor tiers one with processes stays paused (frozen): they "
          f"keep no process's memory on disk ({criu_said})")
    return {"without_processes": tiers, "with_processes": kept, "criu": criu,
            "criu_check": criu_check, "summary": summary}


def _criu_check(criu: str) -> str | None:
    """None if ``criu check`` passes, else its first error line (or why it did not run)."""
    import subprocess

    from .._core.privileged import privileged_env

    try:
        done = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=30,
                              env=privileged_env(), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"it did not run ({exc})"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    first = next((line for line in lines if line.startswith("Error")), lines[0] if lines else "")
    return first[:300] or f"exit status {done.returncode}"


@click.command()
@json_option
@click.pass_context
@handle_errors
def demo(ctx: click.Context, as_json: bool) -> None:
    """Walk through an agent-like session: write code, run it, try to escape, clean up."""
    import io

    from rich.console import Console

    from .demo import run_demo

    console = Console(file=io.StringIO()) if as_json else Console()
    summary = run_demo(home=home_of(ctx), console=console)
    if as_json:
        emit_json(summary)
    contained = all(step.get("contained", True) for step in summary["steps"])
    sys.exit(0 if contained and summary["destroyed"] else EXIT_FAILED)
