"""``corral demo``: an agent-like session, end to end, narrated in the terminal."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from .._core.resources import get_tier
from .._sdk.sandbox import Sandbox
from ..errors import SandboxNotFound
from ..models import CommandResult

__all__ = ["run_demo"]

AGENT_SCRIPT = textwrap.dedent('''\
    """Written by the 'agent': count words in a text and save a report."""
    import collections, json, pathlib, re

    text = pathlib.Path("/workspace/notes.txt").read_text()
    words = re.findall(r"[a-z']+", text.lower())
    top = collections.Counter(words).most_common(5)
    report = {"words": len(words), "top": top}
    pathlib.Path("/workspace/report.json").write_text(json.dumps(report, indent=2))
    print(f"counted {len(words)} words; top: {top[0][0]!r} x{top[0][1]}")
''')

NOTES = (
    "The agent reads the notes, the agent writes the code, and the sandbox runs the code. "
    "Nothing the code does can reach the host, the network or another sandbox.\n"
)

ESCAPES: list[tuple[str, str]] = [
    ("write outside /workspace", "echo pwned > /etc/corral-was-here"),
    ("read the host's password hashes", "cat /etc/shadow"),
    ("open a connection to the internet",
     "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 443), timeout=3)\""),
    ("resolve a host name",
     "python3 -c \"import socket; socket.getaddrinfo('pypi.org', 443)\""),
    ("see the host's processes", "ps -e -o comm= | tr '\\n' ' '"),
]


def _host_uid(home: Path | None, sandbox_id: str) -> int:
    """The sandbox's host uid: the operator's business, so in the store, not in SandboxInfo."""
    from .._control.plane import get_manager
    from .._settings import Settings

    settings = Settings(home=home) if home is not None else Settings()
    if settings.url and home is None:
        return -1  # the sandbox runs in a service; its uid is that host's
    record = get_manager(settings).store.get(sandbox_id)
    return record.uid if record is not None else -1


def _mib(n: int) -> str:
    if n >= 1024**3:
        return f"{n / 1024**3:g} GiB"
    return f"{n / (1024 * 1024):.1f} MiB"


def _last_line(result: CommandResult) -> str:
    text = (result.stderr.strip() or result.stdout.strip()).splitlines()
    return text[-1] if text else f"exit {result.exit_code}"


def run_demo(*, home: Path | None, console: Console | None = None) -> dict[str, Any]:
    """Run the session, narrating on ``console``; return a machine-readable summary."""
    console = console or Console()
    summary: dict[str, Any] = {"steps": []}
    console.print(Panel.fit(
        "[bold]Corral demo[/bold]: an agent writes a script, runs it, and then (as if steered "
        "by a prompt injection) tries to break out.",
        border_style="cyan",
    ))

    started = time.perf_counter()
    sb = Sandbox.create(resources="small", home=home, labels={"purpose": "demo"})
    try:
        info = sb.get_info()
        tier = get_tier(info.resources)
        uid = _host_uid(home, sb.id)
        summary.update(sandbox_id=sb.id, uid=uid, tier=tier.to_dict(),
                       create_ms=round((time.perf_counter() - started) * 1000, 1))
        console.print(
            f"[green]1.[/green] created sandbox [bold]{sb.id}[/bold] in "
            f"{(time.perf_counter() - started) * 1000:.0f} ms — host uid {uid}, "
            f"tier {tier.name}: {tier.cpus:g} CPU, {_mib(tier.memory_bytes)} memory, "
            f"{tier.pids} processes, {_mib(tier.disk_bytes)} disk, no network"
        )

        sb.files.write("/workspace/notes.txt", NOTES)
        sb.files.write("/workspace/count_words.py", AGENT_SCRIPT)
        console.print("[green]2.[/green] the agent wrote [bold]/workspace/count_words.py[/bold]:")
        console.print(Syntax(AGENT_SCRIPT, "python", theme="ansi_dark", line_numbers=False))

        console.print("[green]3.[/green] running it, output streamed as it comes:")
        result = sb.commands.run(
            "python3 count_words.py",
            on_stdout=lambda text: console.print(f"   [dim]│[/dim] {text.rstrip()}"),
        )
        console.print(f"   exit code {result.exit_code} in {result.duration_s * 1000:.0f} ms")
        summary["steps"].append({"step": "run agent script", "ok": result.ok,
                                 "result": result.to_dict()})
        report = json.loads(sb.files.read("/workspace/report.json"))
        summary["report"] = report
        console.print(f"   the report it wrote, read back through the files API: {report}")

        console.print("[green]4.[/green] now the injected instructions try to get out:")
        table = Table(box=None, padding=(0, 2))
        table.add_column("attempt")
        table.add_column("result")
        table.add_column("what the sandbox said", overflow="fold")
        for label, command in ESCAPES:
            attempt = sb.commands.run(command, timeout=10)
            if label == "see the host's processes":
                table.add_row(label, "[green]contained[/green]",
                              f"sees only its own: {attempt.stdout.strip()}")
                summary["steps"].append({"step": label, "contained": True,
                                         "visible": attempt.stdout.split()})
                continue
            summary["steps"].append({"step": label, "contained": not attempt.ok,
                                     "said": _last_line(attempt)})
            verdict = "[red]ESCAPED[/red]" if attempt.ok else "[green]refused[/green]"
            table.add_row(label, verdict, _last_line(attempt))
        console.print(table)

        console.print("[green]5.[/green] a runaway loop meets its timeout:")
        loop = sb.commands.run("while true; do :; done", timeout=2)
        summary["steps"].append({"step": "runaway loop", "contained": loop.timed_out,
                                 "duration_s": round(loop.duration_s, 3)})
        console.print(
            f"   timed_out={loop.timed_out}, exit code {loop.exit_code}, "
            f"killed after {loop.duration_s:.2f} s"
        )

        console.print("[green]6.[/green] resource usage of the agent's script:")
        usage = Table(box=None, padding=(0, 2))
        for column in ("wall time", "CPU time", "peak memory", "OOM killed"):
            usage.add_column(column)
        usage.add_row(f"{result.usage.wall_s * 1000:.0f} ms", f"{result.usage.cpu_s * 1000:.0f} ms",
                      _mib(result.usage.peak_memory_bytes), str(result.usage.oom_killed))
        console.print(usage)
    finally:
        sb.kill()
    try:
        Sandbox.connect(sb.id, home=home)
        gone = False
    except SandboxNotFound:
        gone = True
    summary["destroyed"] = gone
    summary["total_s"] = round(time.perf_counter() - started, 3)
    console.print(
        f"[green]7.[/green] destroyed {sb.id}: processes killed, workspace deleted "
        f"({'gone' if gone else 'STILL THERE'}). Total {time.perf_counter() - started:.1f} s."
    )
    return summary
