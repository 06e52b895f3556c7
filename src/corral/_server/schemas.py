"""The parts of the HTTP API's OpenAPI document the routes share: error answers, media types.

Request bodies are the control plane's request models (``corral._control.requests``): their
validators are the control plane's rules, so a body the API refuses is refused with the
control plane's own error and words, and a body of the wrong shape with ``InvalidRequestError``
(422) naming the field. Responses are the public models of ``corral.models``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query
from pydantic import BaseModel

__all__ = ["ErrorOut"]


class ErrorOut(BaseModel):
    """Every error: a stable code (the SDK raises the matching class) and a message."""

    error: str
    message: str


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorOut, "description": why} for status, why in [
        (400, "Invalid input: bad command, path outside /workspace, unknown tier..."),
        (401, "Missing, unknown or revoked API key."),
        (403, "Refused by policy, beyond the tenant's ceiling (ceiling_exceeded: hosts, "
              "templates, tiers, secrets, lifetime), or a browser Origin that is not the "
              "service's own (origin_refused)."),
        (404, "No such sandbox, snapshot, command, process or file (or not the caller's)."),
        (409, "The sandbox is busy (being created, paused, or running something during a "
              "snapshot or restore), or the snapshot is in use."),
        (413, "The body is over its size limit."),
        (421, "The Host header is not one of the service's names."),
        (422, "The request does not match the schema."),
        (429, "A tenant quota (sandboxes, tiers, commands per minute: commands, background "
              "processes and terminals alike) or a sandbox limit."),
        (500, "An internal error."),
        (503, "The host cannot run sandboxes."),
    ]
}
_NDJSON = {"application/x-ndjson": {"schema": {"type": "string"}}}
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_BINARY_BODY = {"requestBody": {"content": {"application/octet-stream": _BINARY}}}
# Not empty is shown, not enforced here: the control plane refuses "" with its own words.
_PathQuery = Annotated[str, Query(description="A path in /workspace.",
                                  json_schema_extra={"minLength": 1})]
