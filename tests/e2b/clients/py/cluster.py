"""Through a Corral cluster gateway (``corral serve --cluster --e2b-port``), the official
Python SDK (URL mode): create, commands with live output, a background command killed,
files both ways, list, connect, a snapshot and sandboxes from it (on either node), kill
(the test deletes the snapshot).

Usage: python cluster.py
"""

from __future__ import annotations

from _steps import done, step
from e2b import Sandbox

sb = step("create", lambda: Sandbox.create(timeout=180))
step("id", lambda: sb.sandbox_id)
seen: list[str] = []
step("run", lambda: (lambda r: {"stdout": r.stdout, "exit_code": r.exit_code})(
    sb.commands.run("echo one; echo $((6*7))", on_stdout=seen.append)))
step("seen", lambda: "".join(seen))
step("write", lambda: sb.files.write("/home/user/c.txt", "through the cluster").path)
step("read", lambda: sb.files.read("/home/user/c.txt"))
step("cat", lambda: sb.commands.run("cat /home/user/c.txt").stdout)
# Before the background command: a snapshot is refused while anything runs in the sandbox,
# and a killed command may still be exiting for a moment.
snap = step("snapshot", lambda: sb.create_snapshot())
handle = step("background", lambda: sb.commands.run("sleep 60", background=True))
step("kill_background", lambda: sb.commands.kill(handle.pid))
step("listed", lambda: sb.sandbox_id in {
    s.sandbox_id for s in Sandbox.list().next_items()})
step("connect", lambda: Sandbox.connect(sb.sandbox_id).commands.run("echo again").stdout)
step("snapshot_id", lambda: snap.snapshot_id)
children = step("from_snapshot", lambda: [Sandbox.create(template=snap.snapshot_id, timeout=120)
                                          for _ in range(3)])
step("children", lambda: [c.sandbox_id for c in children])
step("children_read", lambda: [c.files.read("/home/user/c.txt") for c in children])
step("snapshots_listed", lambda: [s.snapshot_id for s in Sandbox.list_snapshots().next_items()])
step("kill_children", lambda: [c.kill() for c in children])
step("kill", lambda: sb.kill())
done()
