"""E2B's Template SDK (``Template().from_image(...)...``, ``Template.build``) against Corral's
template-build API, then sandboxes of the built template by name.

Usage: python templates.py BASE_IMAGE   (a registry reference the server's policy allows)
Env: BETA_KEY, another tenant's key (the template must be unknown to it).
"""

from __future__ import annotations

import gzip
import io
import os
import sys
import tarfile
import tempfile
import time

import httpx
from _steps import done, step
from e2b import Sandbox, Template

base = sys.argv[1]
beta_key = os.environ["BETA_KEY"]
api_url = os.environ["E2B_API_URL"]
key = os.environ["E2B_API_KEY"]
context = tempfile.mkdtemp(prefix="e2b-template-ctx-")
os.makedirs(os.path.join(context, "tool", "sub"))
with open(os.path.join(context, "hello.txt"), "w") as f:
    f.write("hello from an uploaded file\n")
with open(os.path.join(context, "tool", "sub", "run.sh"), "w") as f:
    f.write("#!/bin/sh\necho tool ran\n")
os.chmod(os.path.join(context, "tool", "sub", "run.sh"), 0o755)


def template() -> object:
    return (Template(file_context_path=context)
            .from_image(base)
            .set_envs({"GREETING": "hello 'quoted' $HOME"})
            .set_workdir("/opt/app")
            .copy("hello.txt", "/opt/app/")
            .copy("tool", "/opt/tool/")
            .run_cmd(["cat hello.txt > built.txt", "echo \"$GREETING\" >> built.txt",
                      "printf 'line one\\nline two\\n' > /opt/app/multi.txt"])
            # E2B's commands run `/bin/bash -l -c`: busybox's sh stands in for it.
            .run_cmd("printf '#!/bin/sh\\nexec /bin/sh \"$@\"\\n' > /bin/bash && "
                     "chmod 755 /bin/bash", user="root"))


def build(name: str, tpl: object | None = None, **kwargs: object) -> dict[str, object]:
    logs: list[dict[str, str]] = []
    started = time.monotonic()
    info = Template.build(tpl or template(), name,
                          on_build_logs=lambda e: logs.append(
                              {"level": e.level, "message": e.message}), **kwargs)
    return {"template_id": info.template_id, "build_id": info.build_id, "name": info.name,
            "tags": info.tags, "seconds": round(time.monotonic() - started, 2), "logs": logs}


step("build", lambda: build("busy-env:v1"), seconds=400)
step("rebuild", lambda: build("busy-env"), seconds=200)
step("skip_cache", lambda: build("busy-env", skip_cache=True), seconds=200)
step("exists", lambda: [Template.exists(n) for n in ("busy-env", "never-built", "busy-env:v1",
                                                    "busy-env:v9")])


def run_in(template_name: str) -> dict[str, object]:
    sb = Sandbox.create(template_name, timeout=60)
    try:
        out = sb.commands.run("cat /opt/app/built.txt /opt/app/multi.txt; /opt/tool/sub/run.sh")
        return {"template_id": sb.get_info().template_id, "stdout": out.stdout}
    finally:
        sb.kill()


step("sandbox", lambda: run_in("busy-env"), seconds=120)
step("sandbox_tag", lambda: run_in("busy-env:v1"), seconds=120)
step("no_such_tag", lambda: Sandbox.create("busy-env:v9", timeout=30))



def tags() -> dict[str, object]:
    assigned = Template.assign_tags("busy-env:v1", ["prod", "stable"])
    listed = sorted(t.tag for t in Template.get_tags("busy-env"))
    Template.remove_tags("busy-env", "stable")
    return {"assigned": assigned.tags, "same_build": assigned.build_id == next(
                t.build_id for t in Template.get_tags("busy-env") if t.tag == "v1"),
            "listed": listed, "after": sorted(t.tag for t in Template.get_tags("busy-env")),
            "prod_exists": Template.exists("busy-env:prod"),
            "stable_exists": Template.exists("busy-env:stable")}


step("tags", tags)
step("prod_sandbox", lambda: run_in("busy-env:prod"), seconds=120)



def network() -> dict[str, object]:
    # The tenant's ceiling allows the operator's pypi index: the build's RUN reaches it through
    # Corral's gateway, with pip pointed at it (PIP_INDEX_URL).
    build("net-env", Template().from_image(base).run_cmd(
        'wget -q -O /opt/index.html "$PIP_INDEX_URL" && echo "$PIP_INDEX_URL" > /opt/pip_index'
    ).run_cmd("printf '#!/bin/sh\\nexec /bin/sh \"$@\"\\n' > /bin/bash && chmod 755 /bin/bash"))
    sb = Sandbox.create("net-env", timeout=60)
    try:
        return {"stdout": sb.commands.run("cat /opt/index.html /opt/pip_index").stdout}
    finally:
        sb.kill()


step("network", network, seconds=200)

# Another tenant: the name means nothing to it.
step("beta_exists", lambda: Template.exists("busy-env", api_key=beta_key))
step("beta_create", lambda: Sandbox.create("busy-env", timeout=30, api_key=beta_key))
step("beta_tags", lambda: Template.get_tags("busy-env", api_key=beta_key))

# A step that fails: BuildException with the step's own message.
step("failing", lambda: build("busy-fail", Template().from_image(base).run_cmd(
    "echo about to fail && exit 3")), seconds=200)
# Refusals: a bad name, a registry the operator does not allow, a start command.
step("bad_name", lambda: build("Bad Name!"))
step("refused_registry", lambda: build("elsewhere", Template().from_image(
    "registry.invalid/team/tools:1")))
step("start_cmd", lambda: build("with-start", Template().from_image(base).set_start_cmd(
    "sleep 100", "true")))


# A hostile archive, sent the way the SDK sends one (its link, its headers).
def hostile(members: list[tarfile.TarInfo]) -> dict[str, object]:
    headers = {"X-API-KEY": key}
    opened = httpx.post(f"{api_url}/v3/templates", json={"name": "hostile"}, headers=headers)
    opened.raise_for_status()
    files_hash = os.urandom(32).hex()
    link = httpx.get(f"{api_url}/templates/hostile/files/{files_hash}", headers=headers).json()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for member in members:
            data = b"owned\n" if member.isreg() else b""
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    put = httpx.put(link["url"], content=gzip.compress(raw.getvalue()),
                    headers=link.get("headers") or {})
    trigger = httpx.post(
        f"{api_url}/v2/templates/hostile/builds/{opened.json()['buildID']}", headers=headers,
        json={"fromImage": base, "force": False,
              "steps": [{"type": "COPY", "args": ["x", "/opt/x"], "filesHash": files_hash,
                         "force": False}]})
    return {"upload": put.status_code, "message": put.json().get("message"),
            "trigger": trigger.status_code, "trigger_message": trigger.json().get("message")}


def member(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, target, 0o644
    return info




def stolen_link() -> dict[str, object]:
    """Another tenant's try with this tenant's upload link is refused and does not spend it."""
    headers = {"X-API-KEY": key}
    httpx.post(f"{api_url}/v3/templates", json={"name": "stolen"},
               headers=headers).raise_for_status()
    files_hash = os.urandom(32).hex()
    link = httpx.get(f"{api_url}/templates/stolen/files/{files_hash}", headers=headers).json()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        tar.addfile(member("x"), io.BytesIO(b""))
    beta = httpx.put(link["url"], content=raw.getvalue(), headers={"X-API-KEY": beta_key})
    own = httpx.put(link["url"], content=raw.getvalue(), headers=link["headers"])
    again = httpx.put(link["url"], content=raw.getvalue(), headers=link["headers"])
    present = httpx.get(f"{api_url}/templates/stolen/files/{files_hash}", headers=headers)
    return {"beta": beta.status_code, "own": own.status_code, "again": again.status_code,
            "present": present.json()}


step("stolen_link", stolen_link)
step("hostile_dotdot", lambda: hostile([member("x/../../escaped-by-tar.txt")]))
step("hostile_link", lambda: hostile([member("x", tarfile.SYMTYPE, "/etc"),
                                      member("x/escaped-by-tar.txt")]))
done()
