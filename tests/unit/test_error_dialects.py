"""Every error Corral raises on purpose, in every wire dialect (``corral._http.errors``): a
status the dialect's clients know, a body of the dialect's shape, and the error's own message
in it. A new class in ``corral.errors`` is checked here without a line added."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.exceptions import HTTPException

from corral import errors
from corral._e2b import paths
from corral._http.errors import (
    CONNECT_STATUS,
    E2B_HOME,
    INTERNAL_MESSAGE,
    as_connect,
    as_e2b,
    as_e2b_files,
    as_jupyter,
    as_native,
    as_tool_error,
    failure,
    refused,
)

# No trailing period: E2B's hint replaces one; the path: envd's files dialect renames it.
MESSAGE = "the widget in /workspace/data broke"


def _concrete() -> list[type[errors.CorralError]]:
    found: list[type[errors.CorralError]] = []
    pending = list(errors.CorralError.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        # Only the tree itself: a test module's own subclass is no part of the contract.
        if cls.__module__ == errors.__name__ and cls not in found:
            found.append(cls)
    return sorted(found, key=lambda cls: cls.__name__)


CLASSES = _concrete()


def test_the_tree_is_found_whole() -> None:
    exported = {getattr(errors, name) for name in errors.__all__}
    assert set(CLASSES) == {cls for cls in exported
                            if isinstance(cls, type) and issubclass(cls, errors.CorralError)
                            and cls is not errors.CorralError}


@pytest.fixture(params=CLASSES, ids=lambda cls: cls.__name__)
def error(request: pytest.FixtureRequest) -> errors.CorralError:
    cls: type[errors.CorralError] = request.param
    return cls(MESSAGE)


def test_native_is_the_class_own_code_and_status(error: errors.CorralError) -> None:
    status, body = as_native(failure(error))
    assert status == error.status
    assert body == {"error": error.code, "message": MESSAGE}
    assert list(body) == ["error", "message"]
    assert errors.error_class(body["error"]) is type(error)  # what the remote SDK raises back


def test_e2b_rest_is_a_status_the_sdks_map(error: errors.CorralError) -> None:
    status, body = as_e2b(failure(error))
    assert status in {400, 401, 403, 404, 409, 429, 500, 503}
    assert list(body) == ["code", "message"] and body["code"] == status
    assert body["message"].startswith(MESSAGE)
    # A 4xx stays a 4xx, a 5xx a 5xx: the SDK's exception still says whose fault it is.
    assert status // 100 == error.status // 100


def test_e2b_files_is_envds_shape_with_the_sdks_paths(error: errors.CorralError) -> None:
    status, body = as_e2b_files(failure(error))
    assert status < 500 or status in {500, 502, 507}
    assert list(body) == ["message", "code"] and body["code"] == status
    if isinstance(error, errors.SandboxNotFound):
        assert body["message"] == "The sandbox was not found"  # what the SDKs look for
    elif isinstance(error, errors.TooLarge) or not isinstance(
            error, errors.FileError | errors.QuotaExceeded):
        assert body["message"] == MESSAGE
    else:
        assert body["message"] == MESSAGE.replace("/workspace", "/home/user")


def test_connect_is_a_connect_code_with_its_status(error: errors.CorralError) -> None:
    status, body = as_connect(failure(error))
    assert list(body) == ["code", "message"]
    assert body["code"] in CONNECT_STATUS and status == CONNECT_STATUS[body["code"]]
    assert MESSAGE.rstrip(".") in body["message"]
    if isinstance(error, errors.SandboxNotFound):
        # The SDKs tell a gone sandbox (SandboxNotRunning) by code and phrase.
        assert body["code"] == "unavailable"
        assert body["message"].startswith("The sandbox was not found: ")


def test_jupyter_is_plain_text_with_a_status_the_clients_know(
        error: errors.CorralError) -> None:
    status, text = as_jupyter(failure(error))
    assert status in {400, 403, 404, 409, 413, 429, 500}
    assert text == MESSAGE


def test_mcp_is_a_tool_error_with_the_code(error: errors.CorralError) -> None:
    text, structured = as_tool_error(failure(error))
    assert text == f"{error.code}: {MESSAGE}"
    assert structured == {"code": error.code, "message": MESSAGE}
    json.dumps(structured)  # structured content is JSON


def test_a_surfaces_own_refusal_keeps_its_status() -> None:
    assert as_e2b(refused(413, "too big")) == (413, {"code": 413, "message": "too big"})
    assert as_e2b_files(refused(401, "no token")) == (401, {"message": "no token",
                                                            "code": 401})
    assert as_jupyter(refused(400, "no code")) == (400, "no code")
    assert as_connect(refused(421, "wrong host")) == (421, {"code": "invalid_argument",
                                                            "message": "wrong host"})
    assert as_connect(refused(502, "gone"))[1]["code"] == "unavailable"
    assert as_connect(refused(415, "json only"))[1]["code"] == "invalid_argument"
    assert as_connect(refused(503, "busy"))[1]["code"] == "internal"
    assert as_native(refused(404, "Not Found")) == (404, {"error": "not_found",
                                                          "message": "Not Found"})


def test_the_frameworks_refusals_have_codes_of_their_own() -> None:
    assert as_native(failure(HTTPException(405, "Method Not Allowed"))) == (
        405, {"error": "method_not_allowed", "message": "Method Not Allowed"})
    assert as_native(failure(HTTPException(400, "bad JSON")))[1]["error"] == "invalid_request"
    assert as_native(failure(HTTPException(418, "teapot")))[1]["error"] == "http_error"


def test_an_unexpected_error_is_a_500_that_says_nothing_of_it(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    failed = failure(RuntimeError("secret detail"), where="GET /x")
    assert (failed.status, failed.code, failed.message) == (500, "internal_error",
                                                           INTERNAL_MESSAGE)
    for status, body in (as_native(failed), as_e2b(failed), as_connect(failed)):
        assert status == 500 and "secret" not in json.dumps(body)
    assert as_connect(failed)[1]["code"] == "internal"
    # The log has it all: where, and the traceback.
    [record] = [r for r in caplog.records if "GET /x" in r.getMessage()]
    assert record.exc_info is not None and "secret detail" in str(record.exc_info[1])


def test_the_e2b_home_is_the_surfaces() -> None:
    assert E2B_HOME == paths.HOME
