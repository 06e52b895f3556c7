"""Request body limits, and reading a body within one."""

from __future__ import annotations

import os
import re

from fastapi import Request

from .._core.resources import TIERS
from ..errors import TooLarge
from .guard import BodyLimits

__all__ = ["BODY_LIMITS", "MAX_COMMAND_BODY", "MAX_FILE_BODY", "MAX_JSON_BODY", "read_body",
           "write_some"]

MAX_FILE_BODY = 64 * 1024 * 1024
# JSON bodies are parameters, not data; a command's may carry its stdin (64 MiB in the control
# plane), so that one route gets room for it.
MAX_JSON_BODY = 1024 * 1024
MAX_COMMAND_BODY = 96 * 1024 * 1024
_IN_SANDBOX = r"/v1/sandboxes/[^/]+"
BODY_LIMITS = BodyLimits(default=MAX_JSON_BODY, routes=(
    ("POST", re.compile(_IN_SANDBOX + "/commands"), MAX_COMMAND_BODY,
     "pass large input as a file (PUT .../files/content) and redirect from it"),
    ("POST", re.compile(_IN_SANDBOX + "/processes/[^/]+/input"), MAX_FILE_BODY,
     "send input in several requests"),
    ("PUT", re.compile(_IN_SANDBOX + "/files/content"), MAX_FILE_BODY,
     "upload large trees as a tar (PUT .../archive)"),
    # Streamed into the extractor, which enforces the sandbox's own disk limit.
    ("PUT", re.compile(_IN_SANDBOX + "/archive"), max(t.disk_bytes for t in TIERS.values()),
     "that is the largest disk of any resource tier"),
))


async def read_body(request: Request, limit: int, message: str) -> bytes:
    """The body, refused with TooLarge (``message`` formatted with ``limit``) once it is over
    ``limit``: a declared length before reading, a streamed one as it arrives."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(message.format(limit))
    data = bytearray()
    async for chunk in request.stream():
        if len(data) + len(chunk) > limit:
            raise TooLarge(message.format(limit))
        data += chunk
    return bytes(data)


def write_some(fd: int, data: memoryview) -> int:
    try:
        return os.write(fd, data)
    except BrokenPipeError:
        return len(data)  # the extractor stopped (refusal): drain the rest of the body
