"""The JSON bodies of E2B's REST control plane that Corral reads, one frozen model each.

A field's rule and its refusal live on the model, in this surface's words (a 400 the SDKs show
as it is); where the rule is the control plane's own (a lifetime, a command's environment) the
model calls it, so the words are the control plane's on every surface. Unknown fields are
ignored, as E2B's API does for fields a newer SDK sends.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Self

from pydantic import AliasChoices, BeforeValidator, Field

from .._control.plane import validate
from .._control.requests import Fork, SetTimeout
from ..models import Lifecycle
from .common import E2BHTTPError
from .wiremodel import ABSENT, WireModel

__all__ = ["ForkBody", "NetworkBody", "NetworkUpdate", "NewSandbox", "ResumeBody", "SnapshotBody"]

_ABSENT = ABSENT

#: What E2B's create takes that Corral does not offer: refused, never ignored.
_UNSUPPORTED_CREATE = {
    "mcp": "MCP gateways inside sandboxes",
}

_RESUME_NOTICE = ("a resume does not change a sandbox's lifecycle (autoPause, autoResume): it "
                  "is set when the sandbox is created; create it with lifecycle={'on_timeout': "
                  "'pause', 'auto_resume': True} (autoPause, autoResume) to have it paused at "
                  "its timeout and resumed by calls")


def _refuse(message: str) -> E2BHTTPError:
    return E2BHTTPError(400, message)


class _Body(WireModel):
    whole: ClassVar[str] = "the body"

    @classmethod
    def refuse(cls, message: str) -> Exception:
        return _refuse(message)


def _lifetime(value: Any) -> float | None:
    """E2B's ``timeout`` (seconds), refused by the control plane's own rule and words."""
    return None if value is None else SetTimeout.parse({"timeout": value}).timeout


def _is_address(rule: str) -> bool:
    try:
        ipaddress.ip_network(rule, strict=False)
    except ValueError:
        return False
    return True


def _allow_out(value: Any) -> list[str]:
    hosts = value or []
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise _refuse("network.allowOut must be a list of host names")
    for rule in hosts:
        if _is_address(rule):
            raise _refuse(f"network.allowOut {rule!r}: Corral's egress gateway allows host "
                          "names (api.example.com, *.example.com), not IP addresses or ranges")
    return hosts


class NetworkBody(_Body):
    """E2B's ``network`` (create's field, and the body of a network update)."""

    allow_out: Annotated[list[str], BeforeValidator(_allow_out)] = Field(
        default=_ABSENT, validation_alias="allowOut")


def _network(value: Any) -> NetworkBody:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise _refuse("network must be an object")
    return NetworkBody.read(value)


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _asks_pause(value: Any) -> bool:
    return value is True


def _asks_resume(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("enabled") is True


_AutoPause = Annotated[bool, BeforeValidator(_asks_pause)]
_AutoResume = Annotated[bool, BeforeValidator(_asks_resume)]
_Lifetime = Annotated[float | None, BeforeValidator(_lifetime)]


class ResumeBody(_Body):
    """A connect's or resume's body: a new lifetime, and E2B's lifecycle wishes (its resume
    takes autoPause too: SDK 1.x's ``resume(auto_pause=)``)."""

    timeout: _Lifetime = _ABSENT
    auto_pause: _AutoPause = Field(default=_ABSENT, validation_alias="autoPause")
    auto_resume: _AutoResume = Field(default=_ABSENT, validation_alias="autoResume")

    def lifecycle_notice(self, lifecycle: Lifecycle) -> str | None:
        """What the resume asked of ``lifecycle`` (the sandbox's, set at its create) that a
        resume does not change: the answer carries it (``X-Corral-Notice``), and the resume
        goes on (SDK 1.x's ``resume(auto_pause=True)`` must not fail)."""
        asks_more = (self.auto_pause and lifecycle.on_timeout != "pause") or (
            self.auto_resume and not lifecycle.auto_resume)
        return _RESUME_NOTICE if asks_more else None


def _template_id(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _refuse("templateID is required: a template name ('base', 'code-interpreter-v1') "
                      "or a snapshot id")
    return value


def _metadata(value: Any) -> dict[str, Any]:
    value = value or {}
    if not isinstance(value, Mapping):
        raise _refuse("metadata and envVars must be objects of strings")
    return dict(value)  # labels: the control plane's create judges them


def _env_vars(value: Any) -> dict[str, str]:
    value = value or {}
    if not isinstance(value, Mapping):
        raise _refuse("metadata and envVars must be objects of strings")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _refuse("envVars must map names to string values")
    return validate.command_env(value)  # the same rules as any command's env


def _volume_mounts(value: Any) -> dict[str, str]:
    """E2B's ``volumeMounts`` ``[{name, path}]``: Corral volumes of the caller's tenant by
    name (made with ``corral volumes create`` or the SDK's ``Volume.create``)."""
    if value is None:
        return {}
    if not isinstance(value, list) or not all(
            isinstance(m, Mapping) and isinstance(m.get("name"), str)
            and isinstance(m.get("path"), str) for m in value):
        raise _refuse("volumeMounts must be a list of {name, path}")
    return {m["name"]: m["path"] for m in value}


def _supported(body: Any) -> Any:
    if isinstance(body, Mapping):
        for key, what in _UNSUPPORTED_CREATE.items():
            if body.get(key):
                raise _refuse(f"{key}: Corral does not offer {what}")
    return body


class NewSandbox(_Body):
    """``POST /sandboxes``. Its rules run in the order of its fields: what Corral does not
    offer first, then the template, the lifetime, the labels and environment, the network."""

    template_id: Annotated[str, BeforeValidator(_template_id)] = Field(
        default=_ABSENT, validation_alias="templateID")
    timeout: _Lifetime = _ABSENT
    metadata: Annotated[dict[str, Any], BeforeValidator(_metadata)] = _ABSENT
    env_vars: Annotated[dict[str, str], BeforeValidator(_env_vars)] = Field(
        default=_ABSENT, validation_alias="envVars")
    network: Annotated[NetworkBody, BeforeValidator(_network)] = _ABSENT
    #: E2B's ``allow_internet_access`` (SDK 1.x: ``allowInternetAccess``), as asked.
    allow_internet_access: Annotated[bool | None, BeforeValidator(_flag)] = Field(
        default=_ABSENT, validation_alias=AliasChoices("allow_internet_access",
                                                       "allowInternetAccess"))
    volume_mounts: Annotated[dict[str, str], BeforeValidator(_volume_mounts)] = Field(
        default=_ABSENT, validation_alias="volumeMounts")
    auto_pause: _AutoPause = Field(default=_ABSENT, validation_alias="autoPause")
    auto_resume: _AutoResume = Field(default=_ABSENT, validation_alias="autoResume")

    @property
    def lifecycle(self) -> Lifecycle:
        """E2B's ``autoPause`` (``lifecycle={"on_timeout": "pause"}`` in its SDKs) and
        ``autoResume`` as Corral's lifecycle: paused at its timeout and kept, resumed by
        ``connect`` or, with autoResume, by the next call or request."""
        return Lifecycle(on_timeout="pause" if self.auto_pause else "kill",
                         auto_resume=self.auto_resume)

    @classmethod
    def read(cls, body: Mapping[str, Any]) -> Self:
        return super().read(_supported(body))


def _name(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _refuse("name must be a string")
    return value


def _memory(value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _refuse("memory must be true or false")
    return value


class SnapshotBody(_Body):
    """``POST /sandboxes/{id}/snapshots``: a name, and whether to keep the memory too."""

    name: Annotated[str | None, BeforeValidator(_name)] = _ABSENT
    memory: Annotated[bool, BeforeValidator(_memory)] = _ABSENT


class NetworkUpdate(NetworkBody):
    """``PUT /sandboxes/{id}/network``: the network, and whether to add the internet the
    tenant's ceiling allows."""

    allow_internet_access: Annotated[bool | None, BeforeValidator(_flag)] = Field(
        default=_ABSENT, validation_alias=AliasChoices("allow_internet_access",
                                                       "allowInternetAccess"))


def _count(value: Any) -> int:
    return Fork.parse({"count": 1 if value is None else value}).count


class ForkBody(_Body):
    """Corral's fork on the E2B surface: how many, their lifetime, and the memory too."""

    count: Annotated[int, BeforeValidator(_count)] = _ABSENT
    timeout: _Lifetime = _ABSENT
    memory: Annotated[bool, BeforeValidator(_memory)] = _ABSENT
