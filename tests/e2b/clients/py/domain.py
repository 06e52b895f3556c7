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


def fetch_port() -> dict[str, object]:
    """An app's own port through get_host: E2B's traffic token opens it, nothing else does."""
    import ssl
    import time
    import urllib.error
    import urllib.request

    sb.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1",
                    background=True)
    token = getattr(sb, "traffic_access_token", None) or sb._envd_access_token
    url = f"https://{sb.get_host(8000)}/"
    context = ssl.create_default_context()  # trusts SSL_CERT_FILE, the test CA

    def get(headers: dict[str, str]) -> tuple[int, str]:
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    for _ in range(100):
        status, body = get({"E2B-Traffic-Access-Token": token})
        if status != 502:
            break
        time.sleep(0.1)
    return {"host": sb.get_host(8000), "status": status, "listing": "Directory listing" in body,
            "without_token": get({})[0]}


if len(sys.argv) > 3 and sys.argv[3] == "ports":
    step("port", fetch_port)
step("kill", lambda: sb.kill())
done()
