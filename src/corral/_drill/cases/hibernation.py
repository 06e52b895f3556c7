"""Hibernation: a sandbox whose kernel pieces were all released, its ``/tmp`` kept on the host
as an archive (``<home>/sandboxes/<id>/priv/tmp.tar``, root's) or its guest's memory as an
image, and woken from it.

Each case hibernates a sandbox of its own on the drill's tier and attacks what hibernation
adds: the wake rebuilds every piece (is it the same sandbox, as isolated as before?), the image
sits on the host's disk while it sleeps (can another sandbox or tenant read it, or wake it?),
and the wake trusts that image (is one changed on disk refused?). Each needs the host (the
store's record, the archive's path): skipped over a service the drill cannot see into. The
microVM tier keeps no ``/tmp`` image (each command's ``/tmp`` is its own) but keeps a running
process's memory (``<home>/microvm/sandboxes/<id>/hibernated.mem``): there the secret is held
by a process, and the privacy and tampering cases attack that image; a tier that cannot
hibernate at all has every case skipped, saying so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets as _secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from ...errors import BackendError, BackendUnavailable
from ..case import Case
from ..context import BAIT_ALLOWED, DrillContext
from ..model import Evidence, Outcome
from ..target import DrillSandbox

Run = Callable[[DrillContext], Outcome]
HOST = frozenset({"admin"})

# The words a wake from a changed image is refused with (tmparchive's digest check).
_CHANGED = "changed on disk since it hibernated"


class _CannotHibernate(Exception):
    """The drill's tier refuses to hibernate a sandbox: there is nothing to attack."""


def _manager(ctx: DrillContext) -> Any:
    """The process-wide manager of the drill's data directory (the one its SDK sandboxes are
    made by)."""
    from ..._control.plane import get_manager
    from ..._settings import Settings

    home = ctx.target.home
    return get_manager(Settings(home=home) if home is not None else Settings())


def _archive(home: Path, sandbox_id: str) -> Path:
    return home / "sandboxes" / sandbox_id / "priv" / "tmp.tar"


def _memory_image(home: Path, sandbox_id: str) -> Path:
    """Where the microVM tier keeps a hibernated guest's memory (beside its disk)."""
    return home / "microvm" / "sandboxes" / sandbox_id / "hibernated.mem"


def _memory_modes(image: Path, marker: str, uid: int) -> tuple[list[str], str]:
    """What is wrong with a hibernated guest's memory image's owner and mode (its own QEMU's
    uid only: it restores from it), and whether it holds what the guest's process held."""
    if not image.exists():
        raise BackendError(f"no memory image of the hibernated guest at {image}")
    with image.open("rb") as f:
        held = any(marker.encode() in chunk for chunk in iter(lambda: f.read(64 << 20), b""))
    if not held:
        raise BackendError(f"{image} does not hold what the guest's process held in memory")
    wrong, shown = [], []
    for path, mode in ((image.parent, 0o700), (image, 0o400)):
        st = os.stat(path, follow_symlinks=False)
        shown.append(f"{path}: {stat.filemode(st.st_mode)} uid {st.st_uid}")
        if st.st_uid != uid or stat.S_IMODE(st.st_mode) & ~mode:
            wrong.append(f"{path} is {oct(stat.S_IMODE(st.st_mode))} owned by uid "
                         f"{st.st_uid} (the sandbox's uid {uid}'s alone, at most "
                         f"{oct(mode)}, is what it must be)")
    return wrong, "; ".join(shown)


def _hibernate(manager: Any, sandbox_id: str, evidence: list[Evidence]) -> None:
    try:
        info = manager.hibernate(sandbox_id)
    except BackendUnavailable as exc:
        evidence.append(Evidence("response", f"hibernate -> {exc.code}: {exc.message[:200]}",
                                 sandbox=sandbox_id))
        raise _CannotHibernate(exc.message) from None
    evidence.append(Evidence("observation", f"hibernated: state {info.state}, sleeping since "
                                            f"{info.sleeping_since}", sandbox=sandbox_id))
    if info.state != "hibernated":
        raise BackendError(f"hibernate left sandbox {sandbox_id} {info.state}")


def _skipped(exc: _CannotHibernate, evidence: list[Evidence]) -> Outcome:
    return Outcome("skipped", f"this tier cannot hibernate a sandbox: {exc}", tuple(evidence))


# -- the woken sandbox keeps its isolation ---------------------------------------------------

# What a command sees of its isolation, as JSON. Argv: canary port, the host's address (or ""),
# then host paths that must not exist inside.
_PROBE = r"""
import json, os, socket, sys, urllib.error, urllib.request
port, host, paths = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
out = {"uid": os.getuid(), "euid": os.geteuid()}
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
out["seccomp"] = status.get("Seccomp", "?").strip()
out["seen"] = [p for p in paths if os.path.lexists(p)]
def tcp(address):
    try:
        s = socket.create_connection((address, port), timeout=3)
        s.sendall(b"corral-drill: hibernated and woken")
        s.close()
        return "connected"
    except OSError as e:
        return "failed %s" % e.errno
out["tcp"] = {a: tcp(a) for a in ["127.0.0.1"] + ([host] if host else [])}
def route(address):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect((address, 80))
        return "route via " + s.getsockname()[0]
    except OSError as e:
        return "no route %s" % e.errno
out["route"] = {a: route(a) for a in ["192.0.2.1"] + ([host] if host else [])}
proxy = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy")
out["proxy"] = bool(proxy)
if proxy:
    # The gateway that came back with the wake: a host its policy does not allow (asked of
    # the gateway itself, as an agent ignoring NO_PROXY would).
    for name in ("NO_PROXY", "no_proxy"):
        os.environ.pop(name, None)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    try:
        with opener.open("http://127.0.0.1:%d/hibernated" % port, timeout=5) as r:
            out["gateway"] = "status %s" % r.status
    except urllib.error.HTTPError as e:
        out["gateway"] = "status %s" % e.code
    except Exception as e:
        out["gateway"] = "error %s" % type(e).__name__
print(json.dumps(out))
"""


def _probe(ctx: DrillContext, sb: DrillSandbox, paths: list[str],
           evidence: list[Evidence]) -> dict[str, Any]:
    result = ctx.run(["python3", "-c", _PROBE, str(ctx.canary.tcp_port), ctx.host_address or "",
                      *paths], sandbox=sb)
    evidence += ctx.evidence(result, sb)
    try:
        seen: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise BackendError(f"the probe printed no report (exit {result.exit_code}): "
                           f"{(result.stdout + result.stderr)[:200]}") from None
    seen["denied"] = bool(ctx.denials(result, sb))
    return seen


def _escapes(seen: dict[str, Any]) -> list[str]:
    """What a probe's report shows of a sandbox that is not isolated."""
    found = []
    if seen.get("uid") != 1000 or seen.get("euid") != 1000:
        found.append(f"runs as uid {seen.get('uid')}/{seen.get('euid')}, not 1000")
    if seen.get("seccomp") != "2":
        found.append(f"Seccomp: {seen.get('seccomp')} (no filter)")
    if seen.get("seen"):
        found.append(f"host paths visible: {seen['seen']}")
    found += [f"TCP to {a} connected" for a, r in seen.get("tcp", {}).items()
              if r == "connected"]
    found += [f"{a} routable ({r})" for a, r in seen.get("route", {}).items()
              if str(r).startswith("route via")]
    if str(seen.get("gateway", "")).startswith("status 2"):
        found.append(f"the gateway let a request to the host's loopback through "
                     f"({seen['gateway']})")
    return found


def _isolation_after_wake(ctx: DrillContext) -> Outcome:
    """Hibernate a sandbox with an allowlist (so a gateway comes back with it), wake it, and
    ask its first two commands (the second goes through the tier's resident helper) what the
    same probe saw before: uid, filter, network, host paths; and the store what it holds."""
    manager = _manager(ctx)
    home: Path = manager.settings.home
    evidence: list[Evidence] = []
    sb = ctx.fresh(network={"allow": [BAIT_ALLOWED]})
    try:
        paths = [str(home), str(home / "sandboxes" / sb.id), str(_archive(home, sb.id))]
        with ctx.watching() as watch:
            before = [_probe(ctx, sb, paths, evidence) for _ in range(2)]
            uid, policy = manager.store.get(sb.id).uid, manager.get(sb.id).network
            try:
                _hibernate(manager, sb.id, evidence)
            except _CannotHibernate as exc:
                return _skipped(exc, evidence)
            woken = manager.resume(sb.id)
            evidence.append(Evidence("observation", f"resumed: state {woken.state}",
                                     sandbox=sb.id))
            after = [_probe(ctx, sb, paths, evidence) for _ in range(2)]
        uid_after, policy_after = manager.store.get(sb.id).uid, manager.get(sb.id).network
    finally:
        ctx.discard(sb)
    evidence.append(Evidence("observation", f"host uid {uid} before, {uid_after} after; policy "
                                            f"{policy} before, {policy_after} after; inside "
                                            f"after the wake: {after[0]}", sandbox=sb.id))
    problems = [f"before: {p}" for seen in before for p in _escapes(seen)]
    problems += [f"after the wake: {p}" for seen in after for p in _escapes(seen)]
    if uid_after != uid:
        problems.append(f"its host uid changed ({uid} -> {uid_after})")
    if policy_after != policy:
        problems.append(f"its network policy changed ({policy} -> {policy_after})")
    if any(seen.get("proxy") != before[0].get("proxy") for seen in after):
        problems.append("its gateway came back different (a proxy appeared or vanished)")
    if problems:
        return Outcome("breached", "; ".join(problems), tuple(evidence))
    if not all(seen.get("proxy") and seen.get("denied") for seen in before + after):
        return Outcome("error", "no refusal by its gateway was recorded for every probe: "
                       f"{[(s.get('proxy'), s.get('gateway')) for s in before + after]}",
                       tuple(evidence))
    return watch.outcome(f"woken with the same host uid {uid} and network policy; uid 1000, "
                         "Seccomp 2, no route or connection out, the gateway refusing and no "
                         "host path inside, before and after", evidence)


# -- the image is private while it sleeps ----------------------------------------------------

def _api(url: str, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=60)


def _created(api: httpx.Client, body: dict[str, Any], made: list[str]) -> str:
    response = api.post("/v1/sandboxes", json=body)
    if response.status_code != 201:
        raise BackendError(f"create -> {response.status_code} {response.text[:200]}")
    made.append(str(response.json()["id"]))
    return made[-1]


def _ran(api: httpx.Client, sandbox_id: str, cmd: str, **body: Any) -> dict[str, Any]:
    response = api.post(f"/v1/sandboxes/{sandbox_id}/commands", json={"cmd": cmd, **body})
    if response.status_code != 200:
        raise BackendError(f"command in {sandbox_id} -> {response.status_code} "
                           f"{response.text[:200]}")
    result: dict[str, Any] = response.json()
    return result


def _host_modes(archive: Path, marker: str) -> tuple[list[str], str]:
    """What is wrong with the archive's and its directory's owner and mode (as seen on the
    host), and how they are."""
    if not archive.exists():
        raise BackendError(f"no archive of the hibernated sandbox's /tmp at {archive}")
    if marker.encode() not in archive.read_bytes():
        raise BackendError(f"{archive} does not hold what the sandbox wrote to /tmp")
    wrong = []
    shown = []
    for path, mode in ((archive.parent, 0o700), (archive, 0o600)):
        st = os.stat(path, follow_symlinks=False)
        shown.append(f"{path}: {stat.filemode(st.st_mode)} uid {st.st_uid}")
        if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & ~mode or \
                (path == archive and not stat.S_ISREG(st.st_mode)):
            wrong.append(f"{path} is {oct(stat.S_IMODE(st.st_mode))} owned by uid "
                         f"{st.st_uid} (root's, at most {oct(mode)}, is what it must be)")
    return wrong, "; ".join(shown)


# Run by another tenant's sandbox: the archive by path, and a search for it and for what the
# hibernated sandbox wrote to /tmp ($MARK, passed in the environment so the script does not
# carry it). Prints SEEN/FOUND lines; the archive's bytes, if any could be read.
_LOOK = """
for p in "$ARCHIVE" "$PRIV" "$SBX" "$MEMORY"; do [ -e "$p" ] && echo "SEEN $p"; done
cat "$ARCHIVE" 2>/dev/null | head -c 1048576
cat "$MEMORY" 2>/dev/null | grep -caF -- "$MARK" | sed 's/^[1-9].*/FOUND in memory/;/^0$/d'
grep -rslF -- "$MARK" /tmp /workspace 2>/dev/null | head -5 | sed 's/^/FOUND /'
timeout 20 find / -xdev -name tmp.tar 2>/dev/null | head -5 | sed 's/^/FOUND /'
echo looked
"""


def _until_output(api: httpx.Client, process: str, text: str, timeout_s: float = 120) -> None:
    """Wait until a background process has printed ``text`` (an emulated guest is slow)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = api.get(f"{process}/output")
        if answer.status_code == 200 and text in answer.text:
            return
        time.sleep(0.2)
    raise BackendError(f"the process did not print {text!r} within {timeout_s:.0f} s")


def _tenant_calls(own: httpx.Client, other: httpx.Client, path: str,
                  evidence: list[Evidence]) -> list[str]:
    """The other tenant's calls that would wake the sandbox (it wakes on any call): what got
    through, or woke it."""
    calls = (("POST", f"{path}/resume", None), ("POST", f"{path}/commands", {"cmd": "true"}),
             ("GET", f"{path}/files/content?path=/tmp/hib-marker", None),
             ("POST", f"{path}/hibernate", None))
    wrong = []
    for method, url, body in calls:
        answer = other.request(method, url, json=body)
        state = own.get(path).json().get("state")
        evidence.append(Evidence("response", f"tenant B: {method} {url.split('?')[0]} -> "
                                             f"{answer.status_code}; state after: {state}"))
        if answer.status_code != 404:
            wrong.append(f"tenant B's {method} {url.split('?')[0]} answered "
                         f"{answer.status_code}")
        if state != "hibernated":
            wrong.append(f"tenant B's {method} {url.split('?')[0]} left it {state}")
    return wrong


def _image_private(ctx: DrillContext) -> Outcome:
    """Tenant A's sandbox hibernates with a secret in its /tmp; its archive must be root's
    alone on the host, tenant B's sandbox on the same service and tier must neither see its
    path nor find the secret, and tenant B's calls (404) must not wake it. Tenant A's own call
    then wakes it, /tmp intact."""
    access = ctx.service
    assert access is not None
    if access.home is None:
        return Outcome("skipped", "the drill cannot see the service's data directory",
                       (Evidence("observation", "no host path for the service's sandboxes"),))
    marker = f"drill-hibernated-{_secrets.token_hex(12)}"
    body: dict[str, Any] = {"labels": {"corral-drill": "hibernation"}, "timeout": 300,
                            "network": "none", "lifecycle": {"auto_resume": True}}
    isolation = ctx.target.describe().get("isolation")
    if isolation not in (None, "default"):
        body["isolation"] = isolation  # the tier the drill runs on
    evidence: list[Evidence] = []
    made: list[tuple[httpx.Client, str]] = []
    with _api(access.url, access.api_key) as own, _api(access.url, access.other_api_key) as other:
        try:
            ids: list[str] = []
            sleeper = _created(own, body, ids)
            made.append((own, sleeper))
            path = f"/v1/sandboxes/{sleeper}"
            # In /tmp (what the host tiers archive) and in the workspace (what every tier
            # keeps; on the microVM tier each command's /tmp is its own, so none is kept).
            _ran(own, sleeper, f"echo {marker} | tee /tmp/hib-marker > /workspace/hib-marker "
                               "&& chmod 644 /tmp/hib-marker")
            microvm = own.get(path).json().get("isolation") == "microvm"
            holder = None
            if microvm:  # the tier keeps a process's memory: one holds the secret in it
                started = own.post(f"{path}/processes", json={"cmd": [
                    "python3", "-c", "import sys, time\nheld = sys.argv[1] * 64\n"
                    "print('holding', flush=True)\ntime.sleep(3600)", marker]})
                if started.status_code != 201:
                    return Outcome("error", f"starting the holder -> {started.status_code} "
                                   f"{started.text[:200]}", tuple(evidence))
                holder = str(started.json()["id"])
                _until_output(own, f"{path}/processes/{holder}", "holding")
            slept = own.post(f"{path}/hibernate")
            evidence.append(Evidence("response", f"tenant A: POST {path}/hibernate -> "
                                                 f"{slept.status_code} {slept.text[:120]}"))
            if slept.status_code != 200:
                if "cannot hibernate" in slept.text:
                    return Outcome("skipped", f"this tier cannot hibernate a sandbox: "
                                   f"{slept.text[:200]}", tuple(evidence))
                return Outcome("error", f"hibernate -> {slept.status_code}", tuple(evidence))
            archive = _archive(access.home, sleeper)
            memory = _memory_image(access.home, sleeper)
            kept_tmp = archive.exists() or not microvm
            if kept_tmp:
                wrong, modes = _host_modes(archive, marker)
            else:
                wrong, modes = [], f"no /tmp archive ({archive} absent): this tier keeps none"
            if holder is not None:
                # The sandbox's host uid: its QEMU's, which owns its writable disk beside it.
                disks = sorted(memory.parent.glob("*.qcow2")) if memory.parent.is_dir() else []
                uid = disks[0].stat().st_uid if disks else -1
                memory_wrong, memory_modes = _memory_modes(memory, marker, uid)
                wrong += memory_wrong
                modes += f"; {memory_modes} (holds the process's secret)"
            evidence.append(Evidence("observation", f"on the host: {modes}", sandbox=sleeper))
            wrong += _tenant_calls(own, other, path, evidence)
            looker = _created(other, {k: v for k, v in body.items() if k != "lifecycle"}, ids)
            made.append((other, looker))
            looked = _ran(other, looker, _LOOK, timeout=60,
                          envs={"ARCHIVE": str(archive), "PRIV": str(archive.parent),
                                "SBX": str(archive.parent.parent), "MEMORY": str(memory),
                                "MARK": marker})
            out = str(looked.get("stdout", "")) + str(looked.get("stderr", ""))
            lines = [ln for ln in out.splitlines() if ln.startswith(("SEEN ", "FOUND "))]
            evidence.append(Evidence("observation", f"tenant B's sandbox looked: "
                                     f"{lines[:5] or 'nothing found'}, exit "
                                     f"{looked.get('exit_code')}", sandbox=looker))
            if marker in out or lines:
                wrong.append(f"tenant B's sandbox reached the image: {lines[:3]}"
                             + (" and read the secret" if marker in out else ""))
            if "looked" not in out:
                return Outcome("error", f"tenant B's search did not finish: {out[-200:]}",
                               tuple(evidence))
            woke = _ran(own, sleeper, "cat /workspace/hib-marker"
                        + (" /tmp/hib-marker" if kept_tmp else ""))
            found = str(woke.get("stdout")).split().count(marker)
            evidence.append(Evidence("response", f"tenant A's command woke it: exit "
                                     f"{woke.get('exit_code')}, the secret found {found} "
                                     f"time(s) (workspace{', /tmp' if kept_tmp else ''})"))
            if found != (2 if kept_tmp else 1):
                return Outcome("error", "its owner's call did not wake it with its files "
                               "intact", tuple(evidence))
            if holder is not None:
                state = own.get(f"{path}/processes/{holder}").json().get("state")
                evidence.append(Evidence("response", f"its process after the wake: {state}",
                                         sandbox=sleeper))
                if state != "running":
                    return Outcome("error", f"its process did not survive the hibernate "
                                   f"({state})", tuple(evidence))
        finally:
            for api, sandbox_id in made:
                with contextlib.suppress(httpx.HTTPError):
                    api.delete(f"/v1/sandboxes/{sandbox_id}")
    if wrong:
        return Outcome("breached", "; ".join(wrong), tuple(evidence))
    return Outcome("held", ("the archive is root's (0600 in a 0700 directory); " if kept_tmp
                            else "no /tmp archive is kept on this tier; ")
                   + ("the memory image (holding a process's secret) is the sandbox uid's "
                      "alone (0400 in its 0700 directory), and the process ran on after the "
                      "wake; " if holder is not None else "")
                   + "tenant B's sandbox saw neither its path nor the secret; tenant B's calls "
                   "got 404 and it stayed hibernated; its owner's call woke it", tuple(evidence))


# -- a changed image is refused --------------------------------------------------------------

@contextlib.contextmanager
def _put_back(archive: Path, kept: bytes) -> Iterator[None]:
    """Whatever happens, the archive is its own bytes again afterwards."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            archive.write_bytes(kept)


def _tampered(ctx: DrillContext) -> Outcome:
    """Hibernate a sandbox with a secret in /tmp (on the microVM tier, in a process's memory),
    change its archive (memory image) on the host (the secret's bytes flipped: a well-formed
    image with other content; then cut short): each wake must be refused with the reason and
    leave it hibernated; its own bytes put back, it wakes."""
    manager = _manager(ctx)
    marker = f"drill-tamper-{_secrets.token_hex(12)}"
    evidence: list[Evidence] = []
    wrong: list[str] = []
    sb = ctx.fresh()
    try:
        wrote = ctx.run(f"echo {marker} > /tmp/hib-marker && echo ok", sandbox=sb)
        evidence += ctx.evidence(wrote, sb)
        holder = None
        if manager.get(sb.id).isolation == "microvm":  # its image is a process's memory
            holder = manager.processes.start(sb.id, [
                "python3", "-c", "import sys, time\nheld = sys.argv[1] * 64\n"
                "print('holding', flush=True)\ntime.sleep(3600)", marker])
            deadline = time.monotonic() + 120
            while "holding" not in "".join(t for _, _, t in holder.output()):
                if time.monotonic() > deadline:
                    return Outcome("error", "the holder printed nothing", tuple(evidence))
                time.sleep(0.1)
        try:
            _hibernate(manager, sb.id, evidence)
        except _CannotHibernate as exc:
            return _skipped(exc, evidence)
        archive = (_archive(manager.settings.home, sb.id) if holder is None
                   else _memory_image(manager.settings.home, sb.id))
        recorded = (manager.store.hibernated_image(sb.id) or {}).get("digest")
        if not recorded and not archive.exists():
            evidence.append(Evidence("observation", f"the store holds no digest and {archive} "
                                     "is absent", sandbox=sb.id))
            return Outcome("skipped", "this tier keeps no /tmp image on the host (each "
                           "command's /tmp is its own): nothing to tamper with",
                           tuple(evidence))
        kept = archive.read_bytes()
        actual = "sha256:" + hashlib.sha256(kept).hexdigest()
        evidence.append(Evidence("observation", f"{archive}: {len(kept)} bytes, {actual}; the "
                                                f"store holds {recorded}", sandbox=sb.id))
        at = kept.find(marker.encode())
        if recorded != actual or at < 0:
            return Outcome("error", "the archive on disk is not the one the store recorded, "
                           "or does not hold /tmp", tuple(evidence))
        flipped = bytes(b ^ 0x20 for b in marker.encode())
        tampers = (("bytes flipped", kept[:at] + flipped + kept[at + len(flipped):]),
                   ("cut short", kept[: len(kept) // 2]))
        with _put_back(archive, kept):
            for how, data in tampers:
                archive.write_bytes(data)
                try:
                    manager.resume(sb.id)
                    refusal = None
                except BackendError as exc:
                    refusal = exc.message
                state = manager.get(sb.id).state
                evidence.append(Evidence("response", f"resume from an image {how} -> "
                                         f"{'refused: ' + refusal[:160] if refusal else 'woken'}"
                                         f"; state {state}", sandbox=sb.id))
                if refusal is None or state != "hibernated":
                    shown = ctx.run("cat /tmp/hib-marker", sandbox=sb).stdout.strip() \
                        if state == "running" else ""
                    wrong.append(f"woken from an image {how}"
                                 + (f" (its /tmp now says {shown!r})" if shown else ""))
                    break
                if _CHANGED not in refusal:
                    wrong.append(f"refused, but not for the change: {refusal[:160]}")
        if wrong:
            return Outcome("breached", "; ".join(wrong), tuple(evidence))
        manager.resume(sb.id)
        if holder is not None:
            state = holder.info().state
            evidence.append(Evidence("observation", f"its process after the wake: {state}",
                                     sandbox=sb.id))
            if state != "running":
                return Outcome("error", f"its own image put back, it woke without its "
                               f"process ({state})", tuple(evidence))
        else:
            back = ctx.run("cat /tmp/hib-marker", sandbox=sb)
            evidence += ctx.evidence(back, sb)
            if back.stdout.strip() != marker:
                return Outcome("error", f"its own image put back, it woke without its /tmp: "
                               f"{(back.stdout + back.stderr)[:200]}", tuple(evidence))
    finally:
        ctx.discard(sb)
    return Outcome("held", f"both changed images refused ({_CHANGED}), the sandbox left "
                   "hibernated; its own bytes put back, it woke with its "
                   + ("process" if holder is not None else "/tmp"), tuple(evidence))


CASES = [
    Case("hib.isolation-after-wake", "hibernation", "hibernate a sandbox (allowlist, gateway) "
         "and wake it: its commands before and after, the first through the rebuilt pieces and "
         "the second through the tier's resident helper, probe uid, seccomp, TCP and routes to "
         "the host's loopback canary, its address and the Internet, the gateway, and the data "
         "directory's paths", "the same host uid in the store, the same network policy; uid "
         "1000, Seccomp 2, no connection, route or gateway pass, no host path, before and "
         "after", _isolation_after_wake, frozenset({"python3"}) | HOST),
    Case("hib.image-private", "hibernation", "while tenant A's sandbox hibernates with a secret "
         "in /tmp (on the microVM tier, in a running process's memory): tenant B's sandbox on "
         "the same service and tier looks for the image by its host path and searches for it "
         "and the secret; tenant B resumes it, runs a command, reads its /tmp file and "
         "hibernates it by id", "the /tmp archive is root's only (0600 in a 0700 root "
         "directory), a memory image its sandbox uid's only (0400 in its 0700 directory); "
         "neither is visible to the other sandbox; tenant B gets 404 and it stays hibernated; "
         "tenant A's call wakes it with /tmp (and its process) intact", _image_private,
         HOST | {"service", "other-tenant"}),
    Case("hib.tampered-refused", "hibernation", "change a hibernated sandbox's image on the host "
         "(its /tmp archive, or on the microVM tier its memory image: bytes of the secret it "
         "holds flipped; cut short) and wake it",
         f"each wake refused ({_CHANGED}), the sandbox left hibernated; with its own bytes "
         "back it wakes with its /tmp (its process)", _tampered, HOST),
]
