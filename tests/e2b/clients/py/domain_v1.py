"""Domain mode with an ``e2b`` 1.x client (E2B-COMPAT.md §2.3: 1.x knows only E2B_DOMAIN): the
same steps as ``domain.py`` in 1.x's API (``Sandbox()`` creates, ``Sandbox.list()`` is a list).

Usage: python domain_v1.py create | python domain_v1.py use SANDBOX_ID
"""

from __future__ import annotations

import os
import sys

from _steps import done, step
from e2b import Sandbox

assert "E2B_API_URL" not in os.environ and "E2B_SANDBOX_URL" not in os.environ
if sys.argv[1] == "create":
    sb = step("create", lambda: Sandbox(timeout=120))
    step("id", lambda: sb.sandbox_id)
    done()
    sys.exit(0)

sid = sys.argv[2]
sb = step("connect", lambda: Sandbox.connect(sid))
step("run", lambda: sb.commands.run("echo over tls").stdout)
step("exit3", lambda: sb.commands.run("exit 3"))
step("write", lambda: sb.files.write("/home/user/tls.txt", "through the domain").path)
step("read", lambda: sb.files.read("/home/user/tls.txt"))
step("list", lambda: [s.sandbox_id for s in Sandbox.list()])
step("kill", lambda: sb.kill())
done()
