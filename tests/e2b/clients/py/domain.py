"""Domain mode (E2B-COMPAT.md §2.5): only E2B_DOMAIN, HTTPS with the test CA, names resolved by
the private /etc/hosts the harness bind-mounted for this process. Any set (bundled 2.20.3 has no
URL variables to fall back on).

Usage: python domain.py create | python domain.py use SANDBOX_ID

Two processes, because a sandbox's names are known only once it exists: ``create`` makes it and
reports its id; the harness then adds ``<port>-<id>.<domain>`` to the private /etc/hosts (the
stand-in for a real deployment's wildcard DNS record: pyqwest reads the file once, at start) and
``use`` connects to it and drives it.
"""

from __future__ import annotations

import os
import sys

from _steps import done, step
from e2b import Sandbox

assert "E2B_API_URL" not in os.environ and "E2B_SANDBOX_URL" not in os.environ
if sys.argv[1] == "create":
    sb = step("create", lambda: Sandbox.create(timeout=120))
    step("id", lambda: sb.sandbox_id)
    done()
    sys.exit(0)

sid = sys.argv[2]
sb = step("connect", lambda: Sandbox.connect(sid))
step("run", lambda: sb.commands.run("echo over tls").stdout)
step("exit3", lambda: sb.commands.run("exit 3"))
step("write", lambda: sb.files.write("/home/user/tls.txt", "through the domain").path)
step("read", lambda: sb.files.read("/home/user/tls.txt"))
step("list", lambda: [s.sandbox_id for s in Sandbox.list().next_items()])
step("kill", lambda: sb.kill())
done()
