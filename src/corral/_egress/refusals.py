"""What a refused request is told: the words a model reads when the gateway says no.

A model sees only what its client prints, and clients print little of a refusal: curl shows
``CONNECT tunnel failed, response 403`` and nothing else of a refused ``CONNECT``; Python's
``http.client`` (so requests and pip) shows the status line's reason phrase (``Tunnel connection
failed: 403 <reason>``); pip prints a refused index page's status only with ``-v``. So the policy
and the setting that allows the host are said three times: in the reason phrase (short), in
``X-Corral-Refused`` (machine-readable) and in a ``text/plain`` body (the whole hint).

Everything said here is built from what the gateway already checked: the host is normalised
(``[a-z0-9.-]``, at most 253 characters), the port a number, the method an HTTP token; the
rule and the sandbox id are the control plane's own. Nothing else of the request is echoed,
and every part is cut to a bound, so the answer stays short ASCII text whatever was asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy import clip

__all__ = ["POLICY_RULES", "Explained", "explain", "printable"]

# Rules that are the sandbox's policy saying no (the others are malformed requests or an
# unreachable upstream, which no setting changes).
POLICY_RULES = ("network=none", "no-match", "deny", "ip-literal", "forbidden-address")
_HOST_CLIP = 100
_REASON_MAX = 300


def printable(text: str, limit: int = 512) -> str:
    """``text`` as printable ASCII (anything else becomes ``?``), cut to ``limit`` characters:
    safe in a header, a status line and a terminal."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:limit])


@dataclass(frozen=True, slots=True)
class Explained:
    """A refusal in the gateway's words: ``reason`` for the status line, ``header`` for
    ``X-Corral-Refused``, ``body`` for the response."""

    reason: str
    header: str
    body: str


def _kind(rule: str) -> str:
    return "deny" if rule.startswith("deny ") else rule


def explain(*, rule: str, method: str, host: str, port: int,
            sandbox_id: str) -> Explained | None:
    """The refusal of ``method host:port`` by ``rule``, said so a model can act on it; None
    when ``rule`` is not the policy's (a malformed request, an upstream down)."""
    kind = _kind(rule)
    if kind not in POLICY_RULES or not host:
        return None
    if host == "localhost" or host.endswith(".localhost"):
        kind = "forbidden-address"  # loopback: no allow rule would open it
    name = printable(clip(host, _HOST_CLIP), _HOST_CLIP + 30)
    target = name if port in (80, 443) else f"{name}:{port}"
    what = f"network access to {name}:{port} ({printable(method, 40) or 'request'})"
    sid = printable(sandbox_id, 80) or "$CORRAL_SANDBOX_ID"
    allow_hint = (
        f"To allow it, add {target!r} to the sandbox's network allow list (policy field "
        f"network.allow):\n"
        f"  SDK: Sandbox.create(network={{\"allow\": [\"{target}\"]}}), or for this sandbox "
        f"sandbox.network.update(allow=[..., \"{target}\"])\n"
        f"  CLI: corral create --allow {target}, or for this sandbox "
        f"corral network {sid} --allow {target} (this replaces the list: repeat the hosts "
        f"already allowed)\n"
        f"  E2B SDK: Sandbox.create(network={{\"allow_out\": [\"{target}\"]}})\n"
        f"  Package indexes: network={{\"presets\": [\"pypi\"]}} (CLI: --index pypi; also npm, "
        f"debian) opens the operator's index.\n"
        f"If the tenant's ceiling refuses the host, an operator widens it with "
        f"corral tenants set TENANT --allow-host {target}.\n")
    if kind == "network=none":
        why = "this sandbox has no network access (its policy is network='none')"
        short = (f"this sandbox has network='none', so {target} is refused; allow it with "
                 f"network={{'allow': ['{target}']}} (CLI: --allow {target})")
        setting, hint = "network.allow", allow_hint
    elif kind == "no-match":
        why = "no rule of the sandbox's allow list matches it"
        short = (f"{target} is not in this sandbox's network allow list; allow it with "
                 f"network={{'allow': [..., '{target}']}} (CLI: --allow {target})")
        setting, hint = "network.allow", allow_hint
    elif kind == "deny":
        rule_text = printable(rule[5:], 140)
        why = f"it matches the deny rule {rule_text!r}, and deny rules win"
        short = f"{target} matches deny rule {rule_text}; remove it from network.deny"
        setting = "network.deny"
        hint = (f"To allow it, remove {rule_text!r} from the sandbox's network.deny "
                f"(sandbox.network.update(allow=[...], deny=[...]), or "
                f"corral network {sid} --allow ... --deny ...).\n")
    elif kind == "ip-literal":
        why = "it is an IP address, and only host names can be allowed"
        short = "IP addresses are never allowed; ask for the host by name"
        setting = "network.allow"
        hint = "Ask for the host by its name, and allow that name in network.allow.\n"
    else:  # forbidden-address
        why = ("the name resolves to a loopback, private, link-local or otherwise reserved "
               "address")
        short = f"{target} resolves to a forbidden address; only an operator can open it"
        setting = "CORRAL_EGRESS_ALLOW_CIDRS"
        hint = ("Only the operator can open such an address range, for every sandbox, with "
                "CORRAL_EGRESS_ALLOW_CIDRS (and pin names with CORRAL_EGRESS_HOSTS); no "
                "sandbox setting does.\n")
    body = (f"corral: {what} was refused by Corral's network policy: {why}.\n{hint}"
            f"(rule: {printable(rule, 160)}; sandbox: {sid})\n")
    header = (f"policy; host={name}; port={port}; method={printable(method, 40)}; "
              f"rule={printable(kind, 40)}; setting={setting}")
    phrase = printable(f"Forbidden by Corral network policy: {short}", _REASON_MAX)
    return Explained(reason=phrase, header=header, body=body)
