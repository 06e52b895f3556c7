"""``corral drill``: attack this configuration the way a hijacked agent would."""

from __future__ import annotations

import io
import sys

import click

from .._backends import BACKENDS  # the tier names, without the public models behind them
from .common import EXIT_FAILED, emit_json, handle_errors, home_of, json_option


class _Categories(click.Choice):  # type: ignore[type-arg]
    """The drill's categories, read from ``_drill.model`` when first asked for: importing it
    loads the whole drill package (~0.1 s), and `corral --help` loads this module."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        from .._drill.model import CATEGORIES

        return tuple(CATEGORIES)

    @choices.setter
    def choices(self, value: object) -> None:
        """click's __init__ sets it; the drill's own list is the one."""

__all__ = ["drill"]

_STYLE = {"held": "green", "breached": "bold red", "error": "yellow", "skipped": "dim"}


@click.command()
@click.option("--isolation", type=click.Choice(list(BACKENDS)), default=None,
              help="Isolation tier of the drill's sandboxes (default: the configured one).")
@click.option("--template", default=None, help="Template of the drill's sandboxes.")
@click.option("--resources", "-r", default="small", show_default=True,
              help="Resource tier of the drill's sandboxes.")
@click.option("--allow", multiple=True, metavar="RULE",
              help="Your allow rules (the drill adds bait rules under .invalid and localhost).")
@click.option("--url", default=None, help="Drill a Corral service instead of this host's "
              "data directory (default: CORRAL_URL when set).")
@click.option("--api-key", default=None, envvar="CORRAL_API_KEY",
              help="The service key to attack with.")
@click.option("--other-api-key", default=None, envvar="CORRAL_DRILL_OTHER_API_KEY",
              help="A second tenant's key, for the cross-tenant cases.")
@click.option("--ceiling-api-key", default=None, envvar="CORRAL_DRILL_CEILING_API_KEY",
              help="A key of a tenant held to the drill's ceiling (the caller cases; see "
              "corral._drill.context.drill_ceiling).")
@click.option("--quota-api-key", default=None, envvar="CORRAL_DRILL_QUOTA_API_KEY",
              help="A key of a tenant with a small commands-per-minute quota.")
@click.option("--upstream-host", default=None, envvar="CORRAL_DRILL_UPSTREAM_HOST",
              help="A name the service pins to 127.0.0.2 (an allowed operator CIDR), for the "
              "gateway framing cases.")
@click.option("--e2b-url", default=None, envvar="CORRAL_DRILL_E2B_URL",
              help="The service's E2B surface (`corral serve --e2b-port`), for the e2b cases.")
@click.option("--e2b-api-key", default=None, envvar="CORRAL_DRILL_E2B_API_KEY",
              help="An e2b_ key of the --api-key's tenant (`corral keys create TENANT --e2b`).")
@click.option("--e2b-other-api-key", default=None, envvar="CORRAL_DRILL_E2B_OTHER_API_KEY",
              help="An e2b_ key of the --other-api-key's tenant.")
@click.option("--e2b-ceiling-api-key", default=None, envvar="CORRAL_DRILL_E2B_CEILING_API_KEY",
              help="An e2b_ key of the --ceiling-api-key's tenant.")
@click.option("--e2b-domain", default=None, envvar="CORRAL_DRILL_E2B_DOMAIN",
              help="The --e2b-domain the E2B surface serves (domain mode), for the Host "
              "routing cases; --e2b-url is then its https://api.<domain> address.")
@click.option("--case", "case_ids", multiple=True, metavar="ID",
              help="Only these cases (an id, or a prefix such as net or net.ip-literal).")
@click.option("--category", "categories", multiple=True,
              type=_Categories(),
              help="Only these categories.")
@click.option("--list", "list_only", is_flag=True, help="List the cases and exit.")
@json_option
@click.pass_context
@handle_errors
def drill(ctx: click.Context, isolation: str | None, template: str | None, resources: str,
          allow: tuple[str, ...], url: str | None, api_key: str | None,
          other_api_key: str | None, ceiling_api_key: str | None,
          quota_api_key: str | None, upstream_host: str | None, e2b_url: str | None,
          e2b_api_key: str | None, e2b_other_api_key: str | None,
          e2b_ceiling_api_key: str | None, e2b_domain: str | None,
          case_ids: tuple[str, ...],
          categories: tuple[str, ...],
          list_only: bool, as_json: bool) -> None:
    """Run the exfiltration and escape drill against this configuration.

    Creates sandboxes as configured, plants a poisoned document, a fake secret and a victim
    sandbox, then runs every attack case the way a hijacked agent would: network exfiltration,
    credential discovery, filesystem escape, privilege escalation, resource abuse, control-
    plane abuse, a hostile caller (env injection, oversized bodies, gateway framing,
    ceilings, quotas, Host and Origin), and the E2B surface when there is one (keys, other
    tenants' ids, swapped sandbox tokens, signed /files URLs, ceilings through E2B's create).
    Every attack is bounded (capped loops and sizes, loopback-only targets).

    Exits 0 when every case that ran held, 1 on any breach or error.
    """
    from rich.console import Console

    from .._drill.runner import run_drill, select_cases
    from .._drill.target import SdkTarget

    chosen = select_cases(case_ids, categories)
    if not chosen:
        raise click.BadParameter("no case matches", param_hint="--case/--category")
    console = Console(file=io.StringIO() if as_json else sys.stdout)
    if list_only:
        if as_json:
            emit_json([{"id": c.id, "category": c.category, "tries": c.tries,
                        "held_when": c.held_when, "needs": sorted(c.needs)} for c in chosen])
        else:
            for c in chosen:
                console.print(f"[bold]{c.id}[/] ({c.category}): {c.tries} — held when "
                              f"{c.held_when}")
        return
    settings = ctx.obj["settings"]
    url = url or (settings.url if home_of(ctx) is None else None)
    if url and api_key is None and settings.api_key is not None:
        api_key = settings.api_key.get_secret_value()
    # An empty variable means "not given" (a test or a shell exporting VAR="").
    ceiling_api_key, quota_api_key = ceiling_api_key or None, quota_api_key or None
    upstream_host = upstream_host or None
    e2b_url, e2b_api_key = e2b_url or None, e2b_api_key or None
    e2b_other_api_key, e2b_ceiling_api_key = e2b_other_api_key or None, e2b_ceiling_api_key or None
    e2b_domain = e2b_domain or None
    if e2b_url and not url:
        raise click.BadParameter("the embedded drill starts an E2B surface of its own; give "
                                 "--e2b-url with --url", param_hint="--e2b-url")
    if e2b_url and not e2b_api_key:
        raise click.BadParameter("the E2B surface needs an e2b_ key of the drill's tenant "
                                 "(`corral keys create TENANT --e2b`)",
                                 param_hint="--e2b-api-key")
    target = SdkTarget(home=None if url else home_of(ctx) or settings.home, url=url,
                       api_key=api_key, other_api_key=other_api_key,
                       ceiling_api_key=ceiling_api_key, quota_api_key=quota_api_key,
                       upstream_host=upstream_host, e2b_url=e2b_url,
                       e2b_api_key=e2b_api_key, e2b_other_api_key=e2b_other_api_key,
                       e2b_ceiling_api_key=e2b_ceiling_api_key, e2b_domain=e2b_domain,
                       isolation=isolation,
                       template=template, resources=resources)
    err = Console(stderr=True)

    def progress(result: object, index: int, total: int) -> None:
        from .._drill.model import CaseResult

        assert isinstance(result, CaseResult)
        if as_json:
            return
        style = _STYLE[result.verdict]
        err.print(f"[{index:>3}/{total}] [{style}]{result.verdict:<8}[/] {result.id:<26} "
                  f"[dim]{result.observed[:90]}[/]", highlight=False)

    report = run_drill(target, cases=chosen, allow=allow, progress=progress)
    if as_json:
        emit_json(report.to_dict())
    else:
        _render(console, report)
    sys.exit(0 if report.ok else EXIT_FAILED)


def _render(console: object, report: object) -> None:
    from rich.console import Console
    from rich.table import Table

    from .._drill.model import DrillReport

    assert isinstance(console, Console) and isinstance(report, DrillReport)
    table = Table(title=f"corral drill: {report.target.get('transport')} "
                        f"{report.target.get('isolation')} tier", show_lines=False)
    for column in ("case", "verdict", "what it tried", "evidence"):
        table.add_column(column, overflow="fold")
    for r in report.results:
        proof = "; ".join(f"{e.kind}" + (f" #{e.seq}" if e.seq else "") + f": {e.detail}"
                          for e in r.evidence[:2])
        table.add_row(r.id, f"[{_STYLE[r.verdict]}]{r.verdict}[/]", r.tries,
                      proof[:160] or r.observed[:160])
    console.print(table)
    style = "bold green" if report.ok else "bold red"
    console.print(f"[{style}]{report.summary()}[/]")
