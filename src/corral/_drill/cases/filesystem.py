"""Filesystem escape: writes outside the workspace, and links or archives that lead out of it
through Corral's own file API (which runs on the host, as root)."""

from __future__ import annotations

import os
import secrets
import tarfile
from collections.abc import Callable

from ...errors import CorralError
from ..case import Case
from ..context import DrillContext
from ..model import Evidence, Outcome
from ..target import tar_bytes

Run = Callable[[DrillContext], Outcome]


def _refused(script: str, what: str, *, breach_marker: str = "ESCAPED") -> Run:
    """Run ``script``, which prints ``ESCAPED`` when the attempt worked."""
    def run(ctx: DrillContext) -> Outcome:
        result = ctx.run(ctx.fmt(script))
        out = (result.stdout + result.stderr).strip()
        evidence = tuple(ctx.evidence(result))
        if breach_marker in result.stdout:
            return Outcome("breached", f"{what}: {out[:300]}", evidence)
        return Outcome("held", f"{what} refused: {out[:300]}", evidence)
    return run


def _host_path_unchanged(ctx: DrillContext, name: str) -> list[str]:
    """Host paths an escaping write created, removed again once seen (the drill leaves no
    trace even on a broken configuration)."""
    import os

    candidates = [f"/tmp/{name}", f"/{name}", f"/etc/{name}", f"{ctx.fmt('{home}')}/{name}"]
    found = [p for p in candidates if os.path.lexists(p)]
    for path in found:
        os.unlink(path)
    return found


def _file_api(action: str) -> Run:
    """Plant a link inside the sandbox, then ask the host-side file API to follow it."""
    def run(ctx: DrillContext) -> Outcome:
        name = f"drill-escape-{secrets.token_hex(4)}"
        planted = ctx.run(ctx.fmt(
            "ln -sfn /etc/passwd /workspace/link-file; ln -sfn / /workspace/link-root; "
            "ln -sfn {home} /workspace/link-home; echo planted"))
        evidence: list[Evidence] = list(ctx.evidence(planted))
        attempts: list[str] = []
        got: list[str] = []
        ops: list[tuple[str, Callable[[], object]]] = []
        if action == "read":
            ops = [("read link-file", lambda: ctx.attacker.read("/workspace/link-file")),
                   ("read link-root/etc/hostname",
                    lambda: ctx.attacker.read("/workspace/link-root/etc/hostname")),
                   ("read link-home/corral.db",
                    lambda: ctx.attacker.read("/workspace/link-home/corral.db"))]
        else:
            ops = [("write link-root/tmp/NAME",
                    lambda: ctx.attacker.write(f"/workspace/link-root/tmp/{name}", "x")),
                   ("write link-home/NAME",
                    lambda: ctx.attacker.write(f"/workspace/link-home/{name}", "x")),
                   ("write ../NAME", lambda: ctx.attacker.write(f"/workspace/../{name}", "x")),
                   ("write /tmp/NAME", lambda: ctx.attacker.write(f"/tmp/{name}", "x"))]
        for label, op in ops:
            try:
                data = op()
            except CorralError as exc:
                attempts.append(f"{label}: {exc.code}")
                evidence.append(Evidence("response", f"{label} -> {exc.code}: {exc}"))
                continue
            except OSError as exc:  # followed the link, found nothing there
                attempts.append(f"{label}: {exc.strerror}")
                continue
            got.append(label)
            if isinstance(data, bytes) and ctx.leaked(data.decode(errors="replace")):
                got.append("(with a planted secret)")
        escaped = _host_path_unchanged(ctx, name) if action == "write" else []
        if escaped or (action == "read" and got):
            return Outcome("breached", f"the file API followed a link out: {got or escaped}",
                           tuple(evidence))
        if got:
            # A write that "worked" but created nothing outside stayed in the workspace.
            evidence.append(Evidence("observation", f"stayed inside: {got}"))
        return Outcome("held", "; ".join(attempts) or "nothing left the workspace",
                       tuple(evidence))
    return run


def _tar(kind: str) -> Run:
    def run(ctx: DrillContext) -> Outcome:
        name = f"drill-escape-{secrets.token_hex(4)}"
        members: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]] = []
        if kind == "dotdot":
            # Enough ../ to reach / from any depth, so an escape lands in /tmp, where it is
            # seen and removed.
            members = [(tarfile.TarInfo("../" * 32 + f"tmp/{name}"), b"escaped")]
        elif kind == "absolute":
            members = [(tarfile.TarInfo(f"/tmp/{name}"), b"escaped")]
        elif kind == "symlink":
            link = tarfile.TarInfo("out")
            link.type = tarfile.SYMTYPE
            link.linkname = "/tmp"
            members = [link, (tarfile.TarInfo(f"out/{name}"), b"escaped")]
        elif kind == "hardlink":
            link = tarfile.TarInfo("passwd")
            link.type = tarfile.LNKTYPE
            link.linkname = "/etc/passwd"
            members = [link]
        elif kind == "device":
            dev = tarfile.TarInfo("sda")
            dev.type = tarfile.BLKTYPE
            dev.devmajor, dev.devminor = 8, 0
            members = [dev]
        try:
            ctx.attacker.upload_tar(tar_bytes(members))
            answer = "accepted"
        except CorralError as exc:
            answer = f"{exc.code}: {exc}"
        evidence = [Evidence("response", f"upload ({kind}) -> {answer[:200]}")]
        escaped = _host_path_unchanged(ctx, name)
        check = ctx.run("ls -la /workspace/passwd /workspace/sda 2>&1; "
                        "cat /workspace/passwd 2>/dev/null | head -1")
        evidence += ctx.evidence(check)
        if escaped:
            return Outcome("breached", f"the archive wrote outside the workspace: {escaped}",
                           tuple(evidence))
        if kind == "hardlink" and "root:" in check.stdout:
            return Outcome("breached", "a hard link to /etc/passwd was created", tuple(evidence))
        if kind == "device" and any(line.startswith("b") and "sda" in line
                                    for line in check.stdout.splitlines()):
            return Outcome("breached", "a block device node was created", tuple(evidence))
        if answer == "accepted" and kind in ("dotdot", "absolute", "symlink"):
            return Outcome("held", "accepted but nothing landed outside the workspace",
                           tuple(evidence))
        return Outcome("held", f"refused: {answer[:200]}", tuple(evidence))
    return run


CASES = [
    # Each write goes to a new file named for the drill and is removed again at once when it
    # worked, so even a broken configuration keeps its /etc intact.
    Case("fs.write-etc", "filesystem", "plant a file in /etc (as a new sudoers.d or cron "
         "entry would be)", "the root filesystem is read-only",
         _refused("f=/etc/corral-drill-$$; echo x > $f 2>/dev/null && {{ echo ESCAPED $f; "
                  "rm -f $f; }}; echo done", "/etc write")),
    Case("fs.write-usr", "filesystem", "plant a binary in /usr/local/bin", "read-only",
         _refused("f=/usr/local/bin/corral-drill-$$; echo x > $f 2>/dev/null && "
                  "{{ echo ESCAPED $f; rm -f $f; }}; echo done", "/usr write")),
    Case("fs.write-root", "filesystem", "create files at / and in /var, /opt, /root",
         "read-only",
         _refused("for d in / /var /opt /root /srv; do f=$d/corral-drill-$$; "
                  "touch $f 2>/dev/null && {{ echo ESCAPED $f; rm -f $f; }}; done; echo done",
                  "writes outside /workspace")),
    Case("fs.tmp-persists", "filesystem", "leave a file in /tmp and /dev/shm for a later "
         "command, another sandbox or the host", "/tmp is the sandbox's own; /dev/shm each "
         "command's",
         lambda ctx: _persist(ctx)),
    Case("fs.hardlink", "filesystem", "hard-link a host file into the workspace",
         "link() fails across filesystems",
         _refused("ln /etc/passwd /workspace/pw 2>&1 && echo ESCAPED", "hard link")),
    Case("fs.api-symlink-read", "filesystem", "read host files through symlinks planted in the "
         "workspace, via Corral's file API", "the API refuses to follow them", _file_api("read")),
    Case("fs.api-symlink-write", "filesystem", "write outside through planted symlinks and ../, "
         "via Corral's file API", "refused; nothing appears on the host", _file_api("write")),
    Case("fs.tar-dotdot", "filesystem", "upload a tar with ../../ paths", "refused",
         _tar("dotdot")),
    Case("fs.tar-absolute", "filesystem", "upload a tar with an absolute path", "refused",
         _tar("absolute")),
    Case("fs.tar-symlink", "filesystem", "upload a tar with a symlink to /tmp, then a file "
         "through it", "refused", _tar("symlink")),
    Case("fs.tar-hardlink", "filesystem", "upload a tar with a hard link to /etc/passwd",
         "refused", _tar("hardlink")),
    Case("fs.tar-device", "filesystem", "upload a tar holding a block device node", "refused",
         _tar("device")),
    Case("fs.proc-sys", "filesystem", "write /proc/sys (the same value back, so it is harmless)",
         "read-only",
         _refused("v=$(cat /proc/sys/vm/overcommit_memory) && "
                  "echo $v > /proc/sys/vm/overcommit_memory 2>&1 && echo ESCAPED", "/proc/sys")),
    Case("fs.sysfs", "filesystem", "reach /sys (cgroups, devices, firmware)",
         "not mounted",
         _refused("ls /sys/fs/cgroup /sys/class/net /sys/firmware 2>/dev/null | head -3 | "
                  "grep -q . && echo ESCAPED; echo done", "/sys")),
    Case("fs.device-nodes", "filesystem", "create and open device nodes (disks, memory)",
         "mknod refused; no disk or memory devices",
         _refused("mknod /workspace/sda b 8 0 2>/dev/null && echo ESCAPED mknod; "
                  "for d in /dev/sda /dev/vda /dev/mem /dev/kmem /dev/kmsg /dev/port; do "
                  "[ -e $d ] && echo ESCAPED $d; done; echo done", "device nodes")),
    Case("fs.proc-root", "filesystem", "walk out through /proc/1/root and /proc/self/cwd",
         "they lead only to the sandbox's own root",
         # /home/user is the workspace's second mount (the E2B surface's home): it may be
         # there, as the workspace itself and alone.
         _refused("cat /proc/1/root/etc/shadow 2>/dev/null && echo ESCAPED; "
                  "ls -A /proc/1/root/home 2>/dev/null | grep -vqx user && echo ESCAPED home; "
                  "ls -A /proc/1/root/root 2>/dev/null | grep -q . && echo ESCAPED root; "
                  "h=$(stat -c %d:%i /proc/1/root/home/user 2>/dev/null) && "
                  "[ \"$h\" != \"$(stat -c %d:%i /workspace)\" ] && echo ESCAPED home/user; "
                  "echo done", "/proc/*/root")),
]


def _persist(ctx: DrillContext) -> Outcome:
    """/tmp lives as long as its sandbox (a normal Linux view); what must hold is that it is
    that sandbox's alone (never another's, never the host's), and /dev/shm each command's."""
    token = secrets.token_hex(6)
    # Named for this run: a file left by another run (a drill against no sandbox at all, which
    # writes on the host) is never taken for this one's.
    name = f"drill-left-{token}"
    first = ctx.run(f"echo {token} > /tmp/{name}; echo {token} > /dev/shm/{name}; echo ok")
    # While the attacker's files are there: the victim and the host look for them.
    victim = ctx.run(f"cat /tmp/{name} /dev/shm/{name} 2>/dev/null; ls -A /tmp; echo done",
                     sandbox=ctx.victim)
    on_host = os.path.exists(f"/tmp/{name}") or os.path.exists(f"/dev/shm/{name}")
    second = ctx.run(f"cat /dev/shm/{name} 2>/dev/null; rm -f /tmp/{name} /dev/shm/{name}; "
                     "echo done")
    evidence = tuple(ctx.evidence(first) + ctx.evidence(victim, ctx.victim)
                     + ctx.evidence(second))
    if token in victim.stdout:
        return Outcome("breached", "a file left in one sandbox's /tmp showed in another's",
                       evidence)
    if token in second.stdout:
        return Outcome("breached", "a file left in /dev/shm survived into the next command",
                       evidence)
    if on_host:
        return Outcome("breached", "a file left in the sandbox's /tmp reached the host's",
                       evidence)
    return Outcome("held", "/tmp is the sandbox's own (another sandbox and the host see none "
                   "of it); the next command starts with an empty /dev/shm", evidence)
