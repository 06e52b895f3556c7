"""E2B's REST bodies as models: the surface's own refusals (400, words the SDKs show), the
control plane's where the rule is its own (a lifetime, an environment), the order the rules
run in, and the typed values the handlers get."""

from __future__ import annotations

from typing import Any

import pytest

from corral._e2b.bodies import ForkBody, NetworkUpdate, NewSandbox, ResumeBody, SnapshotBody
from corral._e2b.common import E2BHTTPError
from corral.errors import CommandError, CorralError, UsageError
from corral.models import Lifecycle

REFUSED: list[tuple[Any, dict[str, Any], str]] = [
    (NewSandbox, {}, "templateID is required"),
    # What Corral does not offer is refused before anything else is judged.
    (NewSandbox, {"mcp": {"x": 1}}, "mcp: Corral does not offer MCP gateways"),
    (NewSandbox, {"templateID": "base", "metadata": "x"}, "metadata and envVars must be objects"),
    (NewSandbox, {"templateID": "base", "envVars": {"A": 1}}, "envVars must map names to"),
    (NewSandbox, {"templateID": "base", "network": []}, "network must be an object"),
    (NewSandbox, {"templateID": "base", "network": {"allowOut": ["10.0.0.0/8"]}},
     "not IP addresses or ranges"),
    (NewSandbox, {"templateID": "base", "volumeMounts": [{"name": "v"}]},
     "volumeMounts must be a list of {name, path}"),
    (NetworkUpdate, {"allowOut": "a.com"}, "network.allowOut must be a list of host names"),
    (SnapshotBody, {"name": 3}, "name must be a string"),
    (SnapshotBody, {"memory": "yes"}, "memory must be true or false"),
    (ForkBody, {"memory": 1}, "memory must be true or false"),
]


@pytest.mark.parametrize(("model", "body", "words"), REFUSED,
                         ids=[f"{m.__name__}-{i}" for i, (m, _, _) in enumerate(REFUSED)])
def test_a_refusal_is_a_400_in_the_surface_words(model: Any, body: dict[str, Any],
                                                  words: str) -> None:
    with pytest.raises(E2BHTTPError) as refused:
        model.read(body)
    assert refused.value.status == 400 and words in refused.value.message


@pytest.mark.parametrize(("model", "body", "error", "words"), [
    (NewSandbox, {"templateID": "base", "timeout": -1}, UsageError,
     "timeout must be a positive number of seconds"),
    (NewSandbox, {"templateID": "base", "envVars": {"1A": "x"}}, CommandError,
     "invalid environment variable name '1A'"),
    (ResumeBody, {"timeout": "5"}, UsageError, "timeout must be a positive number"),
    (ForkBody, {"count": 0}, CorralError, "count"),
])
def test_the_control_planes_rules_refuse_in_its_own_words(
        model: Any, body: dict[str, Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as refused:
        model.read(body)
    assert words in str(refused.value)


def test_a_create_is_typed() -> None:
    asked = NewSandbox.read({
        "templateID": "base", "timeout": 30, "metadata": {"run": "7"}, "envVars": {"A": "b"},
        "network": {"allowOut": ["api.example.com"]}, "allowInternetAccess": True,
        "volumeMounts": [{"name": "data", "path": "/data"}], "secure": True})
    assert (asked.template_id, asked.timeout, asked.metadata, asked.env_vars) == (
        "base", 30.0, {"run": "7"}, {"A": "b"})
    assert asked.network.allow_out == ["api.example.com"]
    assert asked.allow_internet_access is True and asked.volume_mounts == {"data": "/data"}
    assert asked.lifecycle == Lifecycle()
    bare = NewSandbox.read({"templateID": "base"})
    assert (bare.timeout, bare.network.allow_out, bare.allow_internet_access) == (None, [], None)


def test_a_create_asks_for_a_lifecycle_and_a_resume_cannot_change_it() -> None:
    assert NewSandbox.read({"templateID": "b", "autoPause": True}).lifecycle == Lifecycle(
        on_timeout="pause")
    assert NewSandbox.read({"templateID": "b", "autoPause": True,
                            "autoResume": {"enabled": True}}).lifecycle == Lifecycle(
        on_timeout="pause", auto_resume=True)
    kill, pause = Lifecycle(), Lifecycle(on_timeout="pause", auto_resume=True)
    resume = ResumeBody.read({"autoPause": True, "autoResume": {"enabled": True}})
    assert resume.lifecycle_notice(kill) and resume.lifecycle_notice(pause) is None
    assert ResumeBody.read({"autoPause": False}).lifecycle_notice(kill) is None


def test_fork_and_snapshot_defaults() -> None:
    assert (ForkBody.read({}).count, ForkBody.read({}).memory) == (1, False)
    assert SnapshotBody.read({}) == SnapshotBody(name=None, memory=False)
    assert NetworkUpdate.read({"allow_internet_access": True}).allow_internet_access is True
