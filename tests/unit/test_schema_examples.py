"""The request bodies' examples in the OpenAPI document (what /docs fills "Try it out" with)
are valid requests: each validates against its own model."""

from __future__ import annotations

import pydantic
import pytest

from corral._control import requests


def _request_models() -> list[type[pydantic.BaseModel]]:
    found, pending = [], list(requests.Request.__subclasses__())
    while pending:
        model = pending.pop()
        found.append(model)
        pending += model.__subclasses__()
    return found


MODELS = [m for m in _request_models() if (m.model_config.get("json_schema_extra") or {})]


def test_the_main_requests_have_examples() -> None:
    names = {model.__name__ for model in MODELS}
    assert {"CreateSandbox", "RunCommand", "RunCode", "StartProcess", "SetTimeout"} <= names


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.__name__)
def test_each_example_is_a_valid_request(model: type[pydantic.BaseModel]) -> None:
    extra = model.model_config["json_schema_extra"]
    assert isinstance(extra, dict)
    for example in extra["examples"]:
        model.model_validate(example)
