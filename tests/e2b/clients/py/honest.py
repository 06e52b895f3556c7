"""What the E2B surface says it does: get_host a client can open (URL mode), real metrics,
a pause-on-timeout kept as asked (latest SDK).

Usage: python honest.py
"""

from __future__ import annotations

import datetime
import os
import time

import httpx
from _steps import done, step
from e2b import Sandbox

sb = step("create", lambda: Sandbox.create(timeout=240), seconds=90)
step("id", lambda: sb.sandbox_id)
step("serve", lambda: sb.commands.run(
    "mkdir -p /home/user/site && echo 'served in the sandbox' > /home/user/site/index.html "
    "&& cd /home/user/site && exec python3 -m http.server 8000", background=True) and None)
step("host", lambda: sb.get_host(8000))
step("traffic_token", lambda: sb.traffic_access_token)
step("busy", lambda: sb.commands.run(
    "python3 -c 'import time; t=time.process_time()\nwhile time.process_time()-t<0.5: pass'"
    ).exit_code)
step("metrics", lambda: [{"cpu_count": m.cpu_count, "cpu_used_pct": m.cpu_used_pct,
                          "mem_used": m.mem_used, "mem_total": m.mem_total,
                          "disk_used": m.disk_used, "disk_total": m.disk_total}
                         for m in sb.get_metrics()])
time.sleep(1.2)
step("metrics_again", lambda: len(sb.get_metrics()))
time.sleep(1.2)
step("metrics_until_now", lambda: len(sb.get_metrics(end=datetime.datetime.now())))
step("metrics_an_hour_ago", lambda: len(sb.get_metrics(
    end=datetime.datetime.now() - datetime.timedelta(hours=1))))
time.sleep(11)  # two of E2B's 5 s ticks, sampled without being asked
step("metrics_later", lambda: len(sb.get_metrics()))
step("lifecycle", lambda: sb.get_info().lifecycle)


def pause_on_timeout() -> object:
    paused = Sandbox.create(timeout=60, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        return paused.get_info().lifecycle
    finally:
        paused.kill()


step("pause_on_timeout", pause_on_timeout)
step("connect_auto_pause", lambda: (lambda r: [r.status_code, r.headers.get("x-corral-notice")])(
    httpx.post(f"{os.environ['E2B_API_URL']}/sandboxes/{sb.sandbox_id}/connect",
               json={"autoPause": True, "timeout": 60},
               headers={"X-API-KEY": os.environ["E2B_API_KEY"]})))
step("missing_template", lambda: Sandbox.create(template="no-such-template", timeout=60))
done()
