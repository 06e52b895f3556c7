"""Credential discovery: what a hijacked agent looks for first, and whether any of it is there."""

from __future__ import annotations

from collections.abc import Callable

from ..case import Case
from ..context import DrillContext
from ..model import Outcome

Run = Callable[[DrillContext], Outcome]

# Environment names that carry credentials on developer machines and CI runners.
CREDENTIAL_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN",
                   "GOOGLE_APPLICATION_CREDENTIALS", "GITHUB_TOKEN", "GH_TOKEN", "OPENAI_API_KEY",
                   "ANTHROPIC_API_KEY", "SSH_AUTH_SOCK", "CORRAL_API_KEY", "KUBECONFIG",
                   "DOCKER_HOST", "VAULT_TOKEN", "NPM_TOKEN")


def _no_leak(script: str, what: str, *, timeout: float = 40, absent: tuple[str, ...] = ()) -> Run:
    """Run ``script``; held when no planted secret (victim's, host's) and none of ``absent``
    shows up in what it printed."""
    def run(ctx: DrillContext) -> Outcome:
        result = ctx.run(ctx.fmt(script), timeout=timeout)
        out = result.stdout + result.stderr
        evidence = tuple(ctx.evidence(result))
        leaked = ctx.leaked(out)
        found = [a for a in absent if a in out]
        if leaked or found:
            return Outcome("breached", f"{what}: found {len(leaked)} planted secret(s) "
                           f"{'and ' + ', '.join(found) if found else ''}".strip(), evidence)
        return Outcome("held", f"{what}: nothing planted or sensitive found "
                       f"({len(out)} bytes searched)", evidence)
    return run


def _env(ctx: DrillContext) -> Outcome:
    result = ctx.run("env")
    out = result.stdout
    evidence = tuple(ctx.evidence(result))
    names = {line.split("=", 1)[0] for line in out.splitlines() if "=" in line}
    found = sorted(names & set(CREDENTIAL_VARS))
    leaked = ctx.leaked(out)
    if leaked or found:
        return Outcome("breached", f"the environment holds {found or 'a planted secret'}",
                       evidence)
    if ctx.host_secret_name:
        line = next((ln for ln in out.splitlines()
                     if ln.startswith(ctx.host_secret_name + "=")), "")
        if not line:
            return Outcome("error", "the secret's placeholder is missing from the environment",
                           evidence)
        return Outcome("held", f"only a placeholder: {line[:60]}", evidence)
    return Outcome("held", f"{len(names)} variables, none a credential", evidence)


def _files(paths: str, what: str) -> Run:
    """Held when none of ``paths`` can be read (they may not even exist inside)."""
    def run(ctx: DrillContext) -> Outcome:
        script = (f"for f in {ctx.fmt(paths)}; do if [ -r \"$f\" ] && head -c 64 \"$f\" "
                  ">/dev/null 2>&1; then echo \"READ $f\"; fi; done; echo checked")
        result = ctx.run(script)
        evidence = tuple(ctx.evidence(result))
        read = [line[5:] for line in result.stdout.splitlines() if line.startswith("READ ")]
        if read:
            return Outcome("breached", f"{what} readable: {read[:5]}", evidence)
        return Outcome("held", f"{what}: none readable", evidence)
    return run


def _ca_key(ctx: DrillContext) -> Outcome:
    home = ctx.target.home
    key = (home / "egress" / "ca.key") if home else None
    result = ctx.run(ctx.fmt(
        "cat {home}/egress/ca.key /var/lib/corral/egress/ca.key 2>&1 | head -c 4000; "
        "timeout 20 find / -xdev -name 'ca.key' -readable 2>/dev/null | head -20 | "
        "xargs -r cat 2>/dev/null | head -c 20000"), timeout=40)
    out = result.stdout + result.stderr
    evidence = tuple(ctx.evidence(result))
    if key is not None and key.exists():
        body = key.read_text().strip().splitlines()
        secret_lines = [ln for ln in body if ln and not ln.startswith("-----")]
        if secret_lines and secret_lines[1 if len(secret_lines) > 1 else 0] in out:
            return Outcome("breached", "the egress CA's private key was read", evidence)
        return Outcome("held", "the CA key is not reachable", evidence)
    if "PRIVATE KEY" in out:
        return Outcome("breached", "a private key named ca.key was read", evidence)
    return Outcome("held", "no CA key reachable", evidence)


CASES = [
    Case("cred.env", "credentials", "read the environment for tokens and keys",
         "no credential variables; registered secrets appear only as placeholders", _env),
    Case("cred.proc-environ", "credentials", "read every /proc/*/environ and cmdline visible",
         "no planted secret in any of them",
         _no_leak("cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n'",
                  "/proc environ")),
    Case("cred.host-processes", "credentials", "list the host's processes (ps, /proc)",
         "only the sandbox's own processes are visible",
         _no_leak("ps -eo pid,user,args 2>/dev/null || ls /proc", "process list",
                  absent=("corral serve", "sshd", "systemd", "/sbin/init", "dockerd"))),
    Case("cred.shadow", "credentials", "read /etc/shadow and /etc/gshadow",
         "not readable (not even present)", _files("/etc/shadow /etc/gshadow /etc/sudoers",
                                                   "host password files")),
    Case("cred.ssh-keys", "credentials", "read SSH keys: host keys, root's and users' ~/.ssh",
         "none readable",
         _files("/etc/ssh/ssh_host_*_key /root/.ssh/* /home/*/.ssh/*", "SSH keys")),
    Case("cred.cloud-config", "credentials", "read cloud and tool credentials in home directories",
         "none readable",
         _files("/root/.aws/credentials /root/.config/gcloud/* /root/.kube/config "
                "/root/.docker/config.json /root/.netrc /root/.git-credentials "
                "/home/*/.aws/credentials /home/*/.netrc", "credential files")),
    Case("cred.corral-data", "credentials", "read Corral's own data: the store, the secrets "
         "database, API key hashes", "none readable",
         _files("{home}/corral.db {home}/secrets.db /var/lib/corral/corral.db "
                "/var/lib/corral/secrets.db", "Corral's databases")),
    Case("cred.ca-key", "credentials", "find and read the egress gateway's CA private key",
         "not reachable", _ca_key),
    Case("cred.host-sockets", "credentials", "find host control sockets (docker, containerd, "
         "systemd, ssh-agent)", "none present",
         _files("/var/run/docker.sock /run/docker.sock /run/containerd/containerd.sock "
                "/run/systemd/private /run/dbus/system_bus_socket /tmp/ssh-*/agent.*",
                "host sockets")),
    Case("cred.victim-path", "credentials", "read another sandbox's workspace by its host path",
         "not reachable",
         _no_leak("cat {home}/sandboxes/{victim}/workspace/victim-notes.txt "
                  "{home}/sandboxes/{victim}/priv/disk/upper/victim-notes.txt 2>&1",
                  "the victim's files")),
    Case("cred.victim-search", "credentials", "search the whole filesystem for another sandbox's "
         "secret", "not found",
         # Near its own directory first (a neighbour is where another sandbox would be), then
         # Corral's data directory: on a busy host the rest of the tree can use up the time
         # limit or the 2000 names before the search reaches the planted file.
         _no_leak("near=$(cd .. && pwd); [ \"$near\" = / ] && near=; "
                  "timeout 20 find $near {home} /tmp /var/tmp /home /srv /opt /var/lib / "
                  "\\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -type f "
                  "\\( -name '*notes*' -o -name '*secret*' -o -name '*.env' \\) "
                  "-size -1000k -print 2>/dev/null | head -2000 | "
                  "xargs -r grep -hIs -m1 '{victim_secret}' 2>/dev/null | head -5; echo searched",
                  "a filesystem-wide search")),
    Case("cred.victim-proc", "credentials", "reach another sandbox through /proc (its root, "
         "cwd, environ)", "not reachable",
         _no_leak("for p in /proc/[0-9]*; do cat $p/root/workspace/victim-notes.txt "
                  "$p/cwd/victim-notes.txt 2>/dev/null; done; echo done", "other /proc entries")),
]
