"""``corral setup``: make this host ready for Corral (its Debian packages, checked by the tiers'
own host checks) and, with ``--service``, write the systemd unit for ``corral serve``."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

from .common import EXIT_UNAVAILABLE, EXIT_USAGE, emit_json, handle_errors, json_option

__all__ = ["setup"]


def _corral_executable() -> Path:
    """This install's ``corral``: the unit must run the same code ``setup`` ran from."""
    beside = Path(sys.executable).parent / "corral"
    if beside.is_file():
        return beside
    found = shutil.which("corral")
    if found is None:
        raise click.UsageError("cannot find this install's `corral` executable for the unit; "
                               "run setup as `/path/to/venv/bin/corral setup --service`")
    return Path(found)


@click.command()
@click.option("--dry-run", is_flag=True,
              help="Only say which packages are missing; install nothing, write nothing.")
@click.option("--tests", is_flag=True,
              help="Also the packages the test suite uses (scripts/bootstrap --test).")
@click.option("--service", is_flag=True,
              help="Also write the systemd unit for `corral serve` (corral.service).")
@click.option("--listen", default="127.0.0.1:8080", show_default=True, metavar="HOST:PORT",
              help="With --service: where the service listens (beyond loopback it needs API "
                   "keys, which --check-config verifies before each start).")
@click.option("--unit-path", type=click.Path(path_type=Path), default=None,
              help="With --service: where to write the unit (default "
                   "/etc/systemd/system/corral.service).")
@json_option
@click.pass_context
@handle_errors
def setup(ctx: click.Context, dry_run: bool, tests: bool, service: bool, listen: str,
          unit_path: Path | None, as_json: bool) -> None:
    """Install and check what this host needs to run Corral (Debian/Ubuntu, as root).

    Idempotent: packages already there are only checked, so running it again (after an
    upgrade, from configuration management) changes nothing that is right. Then every tier's
    host checks run, as `corral doctor` does, and say what is still missing.

    \b
    Examples:
      corral setup                      install what is missing, check the tiers
      corral setup --dry-run --json     what would be installed
      corral setup --service --listen 127.0.0.1:8080
                                        also write corral.service, then
                                        systemctl enable --now corral
    """
    from .._core.privileged import privileged_env
    from .._host.packages import groups_for, install
    from .._host.unit import UNIT_PATH, ServiceUnit
    from .tiers import check_lines, echo_tiers, tier_checks

    settings = ctx.obj["settings"]
    if os.geteuid() != 0 and not dry_run:
        raise click.UsageError("corral setup installs packages and writes a systemd unit: run "
                               "it as root (or with --dry-run to see what is missing)")
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise click.BadParameter(f"{listen!r} is not HOST:PORT (like 127.0.0.1:8080)",
                                 param_hint="--listen")

    def progress(line: str) -> None:
        click.echo(f"==> {line}", err=True)

    steps = install(groups_for(tests=tests), dry_run=dry_run, progress=progress)
    unit_written: str | None = None
    if service and not dry_run:
        unit = ServiceUnit(corral=_corral_executable(), home=settings.home, host=host,
                           port=int(port_text), environment_file=Path("/etc/corral/corral.env"))
        target = unit_path or UNIT_PATH
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(unit.render())
        unit_written = str(target)
        progress(f"wrote {target}")
        if target == UNIT_PATH and Path("/run/systemd/system").is_dir():
            subprocess.run(["systemctl", "daemon-reload"], check=False, env=privileged_env())
    tiers = tier_checks(settings)
    ok = all(step.ok and (dry_run or not step.missing) for step in steps) and all(
        check.ok for check in tiers[settings.backend])
    if as_json:
        emit_json({"ok": ok, "dry_run": dry_run,
                   "packages": [dataclasses.asdict(step) for step in steps],
                   "unit": unit_written, "default": settings.backend,
                   "tiers": {name: {"supported": all(c.ok for c in checks),
                                    "checks": check_lines(checks)}
                             for name, checks in tiers.items()}})
    else:
        for step in steps:
            if step.problem:
                click.secho(f"{step.group}: {step.problem}", fg="red", err=True)
            elif step.missing:
                click.echo(f"{step.group}: missing {' '.join(step.missing)} ({step.why})")
            else:
                done = f"installed {' '.join(step.installed)}" if step.installed else "present"
                click.echo(f"{step.group}: {done}")
        echo_tiers(tiers, settings.backend)
        if unit_written:
            running = Path("/run/systemd/system").is_dir()
            click.echo(f"the service unit is {unit_written}: "
                       + ("start it with `systemctl enable --now corral`" if running else
                          "systemd is not running on this system; its ExecStart line runs "
                          "the service by hand"), err=True)
    if dry_run:
        sys.exit(0 if not any(step.missing for step in steps) else EXIT_USAGE)
    sys.exit(0 if ok else EXIT_UNAVAILABLE)
