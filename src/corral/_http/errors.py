"""Errors on the wire: one renderer, one formatter per dialect.

``failure`` turns what a request failed with (a ``CorralError``, the framework's own refusal,
an exception nobody meant) into a ``Failure``: status, code, message. It is the one place that
hands the error to the 5xx log (``errorlog.note``) and logs an unexpected one with its
traceback, so no surface can forget either.

A formatter shapes a ``Failure`` the way one dialect's clients read it: Corral's own JSON
(``as_native``), E2B's REST API (``as_e2b``), envd's ``/files`` (``as_e2b_files``), Connect RPC
(``as_connect``), the code interpreter's plain text (``as_jupyter``) and an MCP tool's error
(``as_tool_error``: the parts only; the ``mcp`` package stays out of the HTTP kit). A surface's
own refusal (a status it chose, no exception) is a ``refused`` failure, shaped the same way.

The E2B formatters send what E2B's SDKs understand, not Corral's statuses as they are: each SDK
maps a fixed set of statuses (or Connect codes) onto its exceptions, and anything else would
reach the user as a bare "unknown error".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException

from .. import errors
from .errorlog import note

__all__ = [
    "CONNECT_STATUS",
    "E2B_HOME",
    "INTERNAL_MESSAGE",
    "Failure",
    "as_connect",
    "as_e2b",
    "as_e2b_files",
    "as_jupyter",
    "as_native",
    "as_tool_error",
    "failure",
    "hinted",
    "refused",
]

logger = logging.getLogger(__name__)

INTERNAL_MESSAGE = "an internal error occurred; the server log has details"

# The codes of the framework's own refusals (unparseable JSON, unknown route, wrong method).
_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}


@dataclass(frozen=True, slots=True)
class Failure:
    """What an error answer says, before a dialect shapes it. ``error`` is what it was made
    of, when anything: some dialects choose their code or status by its class."""

    status: int
    code: str
    message: str
    error: BaseException | None = None


def refused(status: int, message: str) -> Failure:
    """A refusal a surface gives itself, with the status it chose."""
    return Failure(status, _HTTP_CODES.get(status, "http_error"), message)


def failure(exc: BaseException, *, where: str = "a request") -> Failure:
    """The answer ``exc`` makes. An exception that is neither Corral's nor the framework's
    is a 500 whose message says nothing of it (it may hold anything); its traceback goes to
    the log, naming ``where`` it happened."""
    note(exc)  # the 5xx line names the error the answer was made of
    if isinstance(exc, errors.CorralError):
        return Failure(exc.status, exc.code, exc.message, exc)
    if isinstance(exc, HTTPException):
        return Failure(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"),
                       str(exc.detail), exc)
    logger.error("unhandled error in %s", where, exc_info=exc)
    return Failure(500, "internal_error", INTERNAL_MESSAGE, exc)


# -- Corral's own JSON ----------------------------------------------------------------------------


def as_native(failed: Failure) -> tuple[int, dict[str, Any]]:
    """``{"error": code, "message"}`` with the error class's own status: the remote SDK
    raises the same class back from ``code`` (``corral.errors.error_class``)."""
    return failed.status, {"error": failed.code, "message": failed.message}


# -- E2B ------------------------------------------------------------------------------------------

# What to do about a refusal for a Corral reason, for a message that does not say already (one
# with a `command` or a CORRAL_ setting in it does). Most specific class first.
_HINTS: tuple[tuple[type[errors.CorralError], str], ...] = (
    (errors.BackendUnavailable, "run `corral doctor` on the server: it says what this host lacks"),
    (errors.DiskFullError, "free space in /home/user, or create the sandbox on a larger "
                           "resource tier"),
    (errors.ImageError, "`corral templates ls` on the server lists what is built"),
    (errors.QuotaExceeded, "the operator sets the tenant's limits with "
                           "`corral tenants set TENANT`"),
    (errors.PolicyError, "the operator sets the tenant's ceiling with "
                         "`corral tenants set TENANT` (--allow-host, --template, --resources)"),
    (errors.BackendError, "run `corral doctor` on the server"),
)

# The statuses E2B's REST clients map onto an exception of their own.
_E2B_STATUSES = frozenset({400, 401, 403, 404, 409, 429, 500, 503})
# What the E2B SDK's user knows the workspace as (``corral._e2b.paths.HOME``): the kit cannot
# import the surface, and a test keeps the two equal.
E2B_HOME = "/home/user"
_WORKSPACE = "/workspace"
# The SDKs tell a gone sandbox by this phrase (SandboxNotRunning, envd's 502).
_SANDBOX_GONE = "The sandbox was not found"


def hinted(exc: errors.CorralError) -> str:
    """``exc``'s message, with what to do next when it does not say: E2B's users have no
    ``corral`` command at hand and may not know one exists."""
    message = exc.message
    if "`" in message or "CORRAL_" in message:
        return message
    for kind, hint in _HINTS:
        if isinstance(exc, kind):
            return f"{message.rstrip('. ')}; {hint}"
    return message


def as_e2b(failed: Failure) -> tuple[int, dict[str, Any]]:
    """E2B's REST error, ``{"code": status, "message"}``. A Corral error's status outside what
    the SDKs know is the nearest they do; a refusal the surface chose keeps its own."""
    if not isinstance(failed.error, errors.CorralError):
        return failed.status, {"code": failed.status, "message": failed.message}
    status = failed.status if failed.status in _E2B_STATUSES else (
        500 if failed.status >= 500 else 400)
    return status, {"code": status, "message": hinted(failed.error)}


def _shown(message: str) -> str:
    # Corral's file errors name the file API's path; the SDK's user knows it as /home/user.
    return message.replace(_WORKSPACE, E2B_HOME)


def _files_status(exc: errors.CorralError) -> tuple[int, str]:
    # The SDK maps 400 → InvalidArgument, 404 → FileNotFound, 507 → NotEnoughSpace.
    # Most specific class first: several of these subclass each other.
    if isinstance(exc, errors.FileNotFound):
        return 404, _shown(exc.message)
    if isinstance(exc, errors.PathRefused):
        return 403, _shown(exc.message)
    if isinstance(exc, errors.TooLarge):
        return 413, exc.message
    if isinstance(exc, errors.QuotaExceeded):
        return 507, _shown(exc.message)
    if isinstance(exc, errors.FileError):
        return 400, _shown(exc.message)
    if isinstance(exc, errors.SandboxNotFound):
        return 502, _SANDBOX_GONE
    return (exc.status if exc.status < 500 else 500), exc.message


def as_e2b_files(failed: Failure) -> tuple[int, dict[str, Any]]:
    """envd's ``/files`` error, ``{"message", "code"}`` (envd's key order), with paths as the
    SDK's user names them."""
    status, message = (_files_status(failed.error) if isinstance(failed.error, errors.CorralError)
                       else (failed.status, failed.message))
    return status, {"message": message, "code": status}


# The statuses the code interpreter's clients tell apart; anything else is its 500.
_JUPYTER_STATUSES = frozenset({400, 403, 404, 409, 413, 429})


def as_jupyter(failed: Failure) -> tuple[int, str]:
    """The code interpreter's refusal: plain text, as the reference server answers."""
    if not isinstance(failed.error, errors.CorralError):
        return failed.status, failed.message
    return (failed.status if failed.status in _JUPYTER_STATUSES else 500), failed.message


# -- Connect --------------------------------------------------------------------------------------

#: The Connect protocol's codes and the HTTP status each is sent with (connectrpc.com/docs).
CONNECT_STATUS: dict[str, int] = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}

# The Connect code an SDK maps onto the same meaning as a Corral error. Most specific first:
# several of these subclass each other.
_CORRAL_CONNECT: tuple[tuple[type[errors.CorralError], str], ...] = (
    (errors.SandboxNotFound, "unavailable"),  # "...was not found" → SandboxNotRunning
    (errors.FileNotFound, "not_found"),
    (errors.CommandNotFound, "not_found"),
    (errors.SnapshotNotFound, "not_found"),
    (errors.TooLarge, "resource_exhausted"),
    (errors.QuotaExceeded, "resource_exhausted"),
    (errors.AuthError, "unauthenticated"),
    (errors.PolicyError, "permission_denied"),
    (errors.PathRefused, "permission_denied"),
    (errors.SandboxBusy, "failed_precondition"),
    (errors.BackendUnavailable, "unavailable"),
    (errors.BackendError, "internal"),
    (errors.ConfigError, "internal"),
)

# For a refusal by status only (the surface's own, the router's), which it keeps.
_STATUS_CONNECT = {401: "unauthenticated", 403: "permission_denied", 404: "not_found",
                   413: "resource_exhausted", 421: "invalid_argument",
                   429: "resource_exhausted", 502: "unavailable"}


def _connect_code(exc: errors.CorralError) -> str:
    for kind, code in _CORRAL_CONNECT:
        if isinstance(exc, kind):
            return code
    return "invalid_argument" if 400 <= exc.status < 500 else "internal"


def as_connect(failed: Failure) -> tuple[int, dict[str, Any]]:
    """A Connect error, ``{"code", "message"}``. A Corral error gets the code an SDK maps
    onto its meaning, sent with that code's status; a refusal by status keeps its status, with
    the code nearest to it."""
    exc = failed.error
    if isinstance(exc, errors.SandboxNotFound):
        code, message = "unavailable", f"{_SANDBOX_GONE}: {exc.message}"
    elif isinstance(exc, errors.CorralError):
        code, message = _connect_code(exc), hinted(exc)
    else:
        code = _STATUS_CONNECT.get(failed.status,
                                   "internal" if failed.status >= 500 else "invalid_argument")
        return failed.status, {"code": code, "message": failed.message}
    return CONNECT_STATUS[code], {"code": code, "message": message}


# -- MCP ------------------------------------------------------------------------------------------


def as_tool_error(failed: Failure) -> tuple[str, dict[str, Any]]:
    """An MCP tool's error result: its text (``code: message``, what a model reads) and its
    structured content (what a program reads)."""
    return (f"{failed.code}: {failed.message}",
            {"code": failed.code, "message": failed.message})
