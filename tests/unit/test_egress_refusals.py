"""What a refused request is told (``corral._egress.refusals``): the policy, the host, the
setting that allows it, as short printable text."""

from __future__ import annotations

import pytest

from corral._egress.refusals import explain, printable


def _explain(rule: str, host: str = "pypi.org", port: int = 443, method: str = "CONNECT"):
    return explain(rule=rule, method=method, host=host, port=port, sandbox_id="sbx_abc")


def test_network_none_names_the_setting_the_sdk_and_the_cli() -> None:
    said = _explain("network=none")
    assert said is not None
    assert said.reason.startswith("Forbidden by Corral network policy: this sandbox has "
                                  "network='none', so pypi.org is refused")
    assert "network={'allow': ['pypi.org']}" in said.reason and "--allow pypi.org" in said.reason
    assert said.header == ("policy; host=pypi.org; port=443; method=CONNECT; "
                           "rule=network=none; setting=network.allow")
    for words in ('Sandbox.create(network={"allow": ["pypi.org"]})',
                  "corral create --allow pypi.org", "corral network sbx_abc --allow pypi.org",
                  "policy field network.allow", '"presets": ["pypi"]',
                  "corral tenants set TENANT --allow-host pypi.org"):
        assert words in said.body


def test_a_port_other_than_80_and_443_is_part_of_the_rule() -> None:
    said = _explain("no-match", host="api.example.com", port=8443)
    assert said is not None and "--allow api.example.com:8443" in said.body


@pytest.mark.parametrize(("rule", "host", "words"), [
    ("deny upload.pypi.org", "upload.pypi.org", "remove it from network.deny"),
    ("ip-literal", "127.0.0.1", "IP addresses are never allowed"),
    ("forbidden-address", "metadata.internal", "only an operator can open it"),
    ("network=none", "localhost", "only an operator can open it"),
])
def test_each_refusal_of_the_policy_says_what_would_change_it(rule: str, host: str,
                                                              words: str) -> None:
    said = _explain(rule, host=host)
    assert said is not None and words in said.reason


@pytest.mark.parametrize("rule", ["bad-request", "host-mismatch", "dns", "upstream"])
def test_other_refusals_are_not_the_policy(rule: str) -> None:
    assert _explain(rule) is None


def test_everything_said_is_bounded_printable_ascii() -> None:
    said = explain(rule="no-match", method="G\x1bET\r\n", host="a" * 300 + "\u00e9",
                   port=80, sandbox_id="sbx\x07")
    assert said is not None
    for text in (said.reason, said.header):
        assert all(" " <= c <= "~" for c in text) and len(text) <= 512
    assert all(" " <= c <= "~" or c == "\n" for c in said.body) and len(said.body) < 2048
    assert printable("a\x1b[31m\u00e9") == "a?[31m?"
