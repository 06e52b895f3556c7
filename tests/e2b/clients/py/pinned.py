"""The SDK versions frameworks pin (crewAI: e2b 2.20.3 + e2b-code-interpreter 2.6.2; OpenAI
Agents: 2.31.0 + 2.8.1) in URL mode over TLS: these code interpreters ignore
``E2B_SANDBOX_URL`` and dial ``https://49999-<id>.<domain>`` with the domain create answers.

Usage: python pinned.py    (the sandbox is left running, serving port 8000, for the test)
"""

from __future__ import annotations

from _steps import done, step
from e2b_code_interpreter import Sandbox

sb = step("create", lambda: Sandbox.create(timeout=240), seconds=90)
step("id", lambda: sb.sandbox_id)
step("jupyter_url", lambda: sb._jupyter_url)
step("run_code", lambda: sb.run_code("1+1").text)
step("stdout", lambda: sb.run_code("print('from the kernel')").logs.stdout)
step("command", lambda: sb.commands.run("echo pinned").stdout)
step("write", lambda: sb.files.write("/home/user/pinned.txt", "kept").path)
step("read", lambda: sb.files.read("/home/user/pinned.txt"))
step("serve", lambda: sb.commands.run(
    "mkdir -p /home/user/site && echo 'over tls' > /home/user/site/index.html "
    "&& cd /home/user/site && exec python3 -m http.server 8000", background=True) and None)
step("host", lambda: sb.get_host(8000))
step("traffic_token", lambda: sb.traffic_access_token)
done()
