"""Every tier's host checks, run now and shown (``corral doctor``, ``corral setup``,
``corral serve --check-config``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from .._settings import Settings
    from ..backends import HostCheck

__all__ = ["check_lines", "echo_tiers", "tier_checks"]


def tier_checks(settings: Settings) -> dict[str, list[HostCheck]]:
    """Every tier's host checks, run now (``corral doctor``, ``corral setup``)."""
    from .._backends import BACKENDS, load_backend
    from ..backends import HostCheck
    from ..errors import CorralError

    tiers: dict[str, list[HostCheck]] = {}
    for tier in BACKENDS:
        try:
            tiers[tier] = load_backend(settings, tier).check_host()
        except CorralError as exc:  # a tier that cannot even load is reported, not fatal
            tiers[tier] = [HostCheck(tier, False, exc.message, "see the message")]
    return tiers


def check_lines(checks: list[HostCheck]) -> list[dict[str, Any]]:
    return [{"name": c.name, "ok": c.ok, "detail": c.detail, "fix": c.fix} for c in checks]


def echo_tiers(tiers: dict[str, list[HostCheck]], default: str) -> None:
    """Each tier's verdict and checks, with the fix of each failing one."""
    for name, checks in tiers.items():
        good = all(c.ok for c in checks)
        verdict = (click.style("supported", fg="green") if good
                   else click.style("NOT supported", fg="red"))
        click.echo(f"{name} tier{' (default)' if name == default else ''}: {verdict}")
        for c in checks:
            mark = click.style("ok  ", fg="green") if c.ok else click.style("FAIL", fg="red")
            click.echo(f"  {mark} {c.name:16} {c.detail}")
            if not c.ok:
                click.echo(f"       {'':16} fix: {c.fix}")
    usable = [name for name, checks in tiers.items() if all(c.ok for c in checks)]
    click.echo(f"this host can run Corral sandboxes with isolation: {', '.join(usable)}"
               if usable else
               "this host cannot run Corral sandboxes safely; fix the FAIL lines above",
               err=True)
