"""The base of the E2B dialect's request models: envd's Connect messages (``messages``) and the
REST control plane's bodies (``bodies``).

Frozen; unknown fields ignored (proto3's JSON mapping and E2B's API both let a newer client send
more); every field's rule runs even when the field is absent (``validate_default``: the rule
says what absence means, a default or a refusal). A rule raises the dialect's own error, or the
control plane's when the rule is the control plane's; a shape no rule words becomes the
dialect's refusal through ``refuse``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import CorralError

__all__ = ["ABSENT", "WireModel"]

#: An absent field's value: its rule runs on it too and says what absence means.
ABSENT: Any = None


class WireModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", validate_default=True)

    #: What the whole message is called in a refusal of its shape.
    whole: ClassVar[str] = "the message"

    @classmethod
    def refuse(cls, message: str) -> Exception:
        """The dialect's refusal: a Connect error, an HTTP answer."""
        raise NotImplementedError

    @classmethod
    def read(cls, data: Mapping[str, Any]) -> Self:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problem = exc.errors()[0]
            raised = (problem.get("ctx") or {}).get("error")
            if isinstance(raised, CorralError):  # a control plane rule's own refusal
                raise raised from None
            where = ".".join(str(part) for part in problem["loc"]) or cls.whole
            raise cls.refuse(f"{where}: {problem['msg']}") from None
