"""What crosses between a client and an app a sandbox serves: the one rule set of every relay
to a sandbox's port (the port proxy's two URL forms, the E2B dialect's, the cluster gateway's).

A sandbox's app is tenant code, and whatever it is sent it may keep and replay, and whatever it
answers reaches the client's browser. So:

* **Up**, a request loses every credential of Corral's before the app sees it: the cookies
  Corral sets (the dashboard's session, a signed link's port cookie), an ``Authorization`` or
  ``X-API-Key`` that carries a Corral key or token, E2B's access tokens and every
  ``X-Corral-*`` header. A credential is recognised by its prefix (``CREDENTIAL_PREFIXES``):
  whatever an app is sent that is not Corral's passes unchanged.
* **Down**, an answer never sets, replaces or clears a cookie Corral uses, and never clears
  the site's data (``Clear-Site-Data`` reaches past its origin to the whole site's cookies).
  An answer on an origin that more than one sandbox (and the service) shares — the path form,
  ``/ports/<sandbox>/<port>/`` on the service's own origin — is put in a sandbox of its own by
  ``Content-Security-Policy: sandbox`` without ``allow-same-origin``: the browser gives the page
  a unique, opaque origin, so its scripts run with none of the service's authority (no cookie
  of the origin is sent for them, no answer of the service is readable, no storage is shared
  with another sandbox's page). What would act on the shared origin beyond the page itself
  (every ``Set-Cookie``, HSTS, ``Alt-Svc``, reporting endpoints, service-worker scopes) is
  dropped there too. See docs/ports-and-volumes.md, "Origins".
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["CREDENTIAL_PREFIXES", "SHARED_ORIGIN_CSP", "answer_headers", "is_corral_cookie",
           "is_corral_credential", "request_headers"]

#: How every credential Corral hands out begins: an API key (``ck_``), an E2B-format key
#: (``e2b_``), a port token (``cpt_``), a cluster gateway's signed caller (``cp1.``), the
#: dashboard's session (``us1.``). ``tests/unit/test_preview.py`` holds each maker to it.
CREDENTIAL_PREFIXES = ("ck_", "e2b_", "cpt_", "cp1.", "us1.")
#: Every cookie Corral sets is named so (``corral_session``, ``corral_port_<id>_<port>``),
#: with the ``__Host-`` prefix over https.
_COOKIE_PREFIXES = ("corral_", "__host-corral_", "__secure-corral_")
# Headers that name a credential whatever their value: E2B's envd and traffic tokens (plain
# HMACs, no prefix) and Corral's own.
_CREDENTIAL_HEADERS = frozenset({b"x-access-token", b"e2b-traffic-access-token"})
# Headers whose value is a credential when it is one of Corral's.
_MAYBE_CREDENTIAL = frozenset({b"authorization", b"x-api-key"})

#: The shared origin's pages run with an opaque origin: scripts, forms, pop-ups and downloads
#: work, but nothing of the origin (cookies, storage, the service's answers) is theirs.
SHARED_ORIGIN_CSP = (b"sandbox allow-scripts allow-forms allow-popups allow-modals "
                     b"allow-downloads allow-pointer-lock allow-presentation")
# What an answer may not do on an origin it shares: each acts on the origin, not the page.
_SHARED_ORIGIN_DROPPED = frozenset({
    b"set-cookie", b"set-cookie2", b"strict-transport-security", b"alt-svc", b"nel",
    b"report-to", b"reporting-endpoints", b"service-worker-allowed", b"origin-agent-cluster",
    b"public-key-pins", b"expect-ct"})
# Acts beyond the answer's origin, on the whole site's cookies and storage.
_NEVER = frozenset({b"clear-site-data", b"set-cookie2"})


def is_corral_credential(value: str | bytes) -> bool:
    """Whether ``value`` (a header's value, with or without its ``Bearer`` scheme) is one of
    Corral's credentials."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    scheme, space, rest = text.strip().partition(" ")
    token = rest.strip() if space and scheme.lower() in ("bearer", "token") else text.strip()
    return token.startswith(CREDENTIAL_PREFIXES)


def is_corral_cookie(name: str | bytes) -> bool:
    text = name.decode("latin-1") if isinstance(name, bytes) else name
    return text.strip().lower().startswith(_COOKIE_PREFIXES)


def _without_corral_cookies(value: bytes) -> bytes:
    kept = [part for part in (p.strip() for p in value.split(b";"))
            if part and not is_corral_cookie(part.partition(b"=")[0])]
    return b"; ".join(kept)


def request_headers(headers: Iterable[tuple[bytes, bytes]],
                    drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """``headers`` (lower-case names) as an app may see them: without Corral's credentials,
    Corral's own headers and the names in ``drop`` (the relay's hop-by-hop ones)."""
    kept: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name in drop or name in _CREDENTIAL_HEADERS or name.startswith(b"x-corral-"):
            continue
        if name in _MAYBE_CREDENTIAL and is_corral_credential(value):
            continue
        if name == b"cookie":
            value = _without_corral_cookies(value)
            if not value:
                continue
        kept.append((name, value))
    return kept


def answer_headers(headers: Iterable[tuple[bytes, bytes]], *,
                   shared_origin: bool) -> list[tuple[bytes, bytes]]:
    """An app's answer headers as a client may get them. ``shared_origin``: the answer is
    delivered on an origin it shares with the service and other sandboxes (the path form)."""
    kept: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name in _NEVER:
            continue
        if shared_origin and name in _SHARED_ORIGIN_DROPPED:
            continue
        if name == b"set-cookie" and is_corral_cookie(value.partition(b"=")[0]):
            continue
        kept.append((name, value))
    if shared_origin:
        kept.append((b"content-security-policy", SHARED_ORIGIN_CSP))
    return kept
