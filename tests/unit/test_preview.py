"""The rules of what crosses between a client and a sandbox's app (``_http.preview``), and
the framing a relay refuses (``_http.relay.framing_refusal``), without a sandbox."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from corral._cluster.peer import new_secret, sign_caller
from corral._control.tenants import local_tenant, new_key
from corral._http.preview import (
    SHARED_ORIGIN_CSP,
    answer_headers,
    is_corral_credential,
    request_headers,
)
from corral._http.relay import framing_refusal
from corral._ui.session import UISessions


def test_every_credential_corral_hands_out_is_recognised() -> None:
    class Keys:
        def sign_in(self, key: str) -> tuple[str, object]:
            return "0123456789ab", local_tenant()

    with tempfile.TemporaryDirectory() as home:
        session, _ = UISessions(lambda: Path(home), Keys()).sign_in("ck_x")  # type: ignore[arg-type]
    made = [new_key()[1], new_key(e2b=True)[1], sign_caller(local_tenant(), new_secret()),
            session, "cpt_" + "0" * 40]
    for credential in made:
        assert is_corral_credential(credential), credential
        assert is_corral_credential(f"Bearer {credential}"), credential
    for theirs in ("Bearer eyJhbGciOi.x.y", "Basic dXNlcjpwYXNz", "sk-live-123", "token abc"):
        assert not is_corral_credential(theirs), theirs


def test_a_request_loses_corral_credentials_and_keeps_the_rest() -> None:
    sent = [(b"host", b"app"), (b"authorization", b"Bearer ck_0123456789ab_secret"),
            (b"x-api-key", b"e2b_0123"), (b"x-access-token", b"f" * 48),
            (b"e2b-traffic-access-token", b"e" * 48), (b"x-corral-port-token", b"cpt_1"),
            (b"x-corral-ui", b"1"),
            (b"cookie", b"corral_session=us1.a.b; theirs=1; __Host-corral_session=x; "
                        b"corral_port_sbx_1_80=cpt_2; other=2"),
            (b"connection", b"keep-alive"), (b"x-theirs", b"kept")]
    assert request_headers(sent, frozenset({b"connection"})) == [
        (b"host", b"app"), (b"cookie", b"theirs=1; other=2"), (b"x-theirs", b"kept")]
    # The app's own credentials pass.
    assert request_headers([(b"authorization", b"Bearer their.jwt"),
                            (b"x-api-key", b"sk-123")]) == [
        (b"authorization", b"Bearer their.jwt"), (b"x-api-key", b"sk-123")]
    # A Cookie header that held only Corral's cookies is gone.
    assert request_headers([(b"cookie", b"corral_session=1")]) == []


def test_an_answer_sets_no_corral_cookie_and_the_shared_origin_is_sandboxed() -> None:
    answer = [(b"content-type", b"text/html"), (b"set-cookie", b"corral_session=x; Path=/"),
              (b"set-cookie", b"__Host-corral_session=x; Path=/; Secure"),
              (b"set-cookie", b"Corral_Port_x=1"), (b"set-cookie", b"theirs=1"),
              (b"clear-site-data", b'"cookies"'), (b"strict-transport-security", b"max-age=1"),
              (b"nel", b"{}"), (b"report-to", b"{}"), (b"alt-svc", b'h3=":1"'),
              (b"service-worker-allowed", b"/"), (b"content-security-policy", b"img-src *")]
    own = answer_headers(answer, shared_origin=False)
    assert own == [(b"content-type", b"text/html"), (b"set-cookie", b"theirs=1"),
                   (b"strict-transport-security", b"max-age=1"), (b"nel", b"{}"),
                   (b"report-to", b"{}"), (b"alt-svc", b'h3=":1"'),
                   (b"service-worker-allowed", b"/"),
                   (b"content-security-policy", b"img-src *")]
    shared = answer_headers(answer, shared_origin=True)
    assert shared == [(b"content-type", b"text/html"),
                      (b"content-security-policy", b"img-src *"),
                      (b"content-security-policy", SHARED_ORIGIN_CSP)]
    assert b"allow-same-origin" not in SHARED_ORIGIN_CSP


@pytest.mark.parametrize(("headers", "version", "status"), [
    ([(b"content-length", b"5"), (b"transfer-encoding", b"chunked")], "1.1", 400),
    ([(b"transfer-encoding", b"gzip, chunked")], "1.1", 501),
    ([(b"transfer-encoding", b"chunked"), (b"transfer-encoding", b"chunked")], "1.1", 501),
    ([(b"transfer-encoding", b"chunked")], "1.0", 400),
    ([(b"content-length", b"3"), (b"content-length", b"3")], "1.1", 400),
    ([(b"content-length", b"-1")], "1.1", 400),
    ([(b"content-length", b"3")], "1.1", None),
    ([(b"transfer-encoding", b"Chunked")], "1.1", None),
    ([], "1.0", None),
])
def test_a_relay_refuses_what_could_be_framed_two_ways(
        headers: list[tuple[bytes, bytes]], version: str, status: int | None) -> None:
    refusal = framing_refusal({"type": "http", "headers": headers, "http_version": version})
    assert (refusal.status if refusal else None) == status
