"""Every error Corral raises on purpose.

The tree::

    CorralError
    ├── ConfigError            settings or host configuration is wrong
    ├── AuthError              missing, unknown or revoked API key (HTTP service)
    ├── RequestRefused         the request itself is refused before it is served
    │   ├── HostRefused        a Host header the service does not answer to (DNS rebinding)
    │   └── OriginRefused      a browser Origin that may not drive the service (CSRF, WebSocket)
    ├── UsageError             the caller misused an object (also a RuntimeError)
    │   └── InvalidRequestError a request of the wrong shape: unknown, missing or mistyped field
    ├── SandboxError
    │   ├── SandboxNotFound
    │   │   └── SandboxExpired its TTL has passed; it has been destroyed
    │   ├── SandboxLost        the cluster node it lived on is gone (``corral serve --cluster``)
    │   └── SandboxBusy        being created or destroyed by someone else
    ├── SnapshotError
    │   ├── SnapshotNotFound
    │   └── SnapshotInUse      sandboxes are built on it; it cannot be deleted
    ├── CommandError           a command could not be started (bad argv, cwd, env)
    ├── CommandNotFound        no such running command (kill)
    ├── ContextNotFound        no such code-interpreter context in the sandbox
    ├── InterpreterUnavailable the sandbox cannot run a kernel of that language
    ├── FileError              a file operation failed
    │   ├── PathRefused        the path leaves /workspace (.., absolute, symlink)
    │   └── FileNotFound
    ├── BackendError           the isolation backend failed
    │   └── BackendUnavailable a kernel feature or host tool is missing
    ├── DiskFullError          the data directory's disk is full (HTTP 507); nothing was changed
    ├── ImageError             an image could not be pulled or is refused as unsafe
    ├── PortError              an exposed port could not be served
    │   ├── PortNotExposed     the sandbox's owner has not exposed that port
    │   └── PortClosed         exposed, but nothing in the sandbox listens on it
    ├── VolumeError
    │   ├── VolumeNotFound
    │   └── VolumeInUse        mounted by a sandbox (delete), or held by a writer (mount)
    ├── PolicyError
    │   ├── CeilingExceeded    beyond what the operator lets this tenant ever ask for
    │   ├── ImageRefused       an image from a registry or in a form the operator does not allow
    │   └── QuotaExceeded      a tenant or sandbox limit: no free uid, too many sandboxes, ...
    │       └── TooLarge       a request body or file over its size limit
    └── TransportError         the remote SDK could not reach the service

Each class carries a stable ``code`` and an HTTP ``status`` (the service sends
``{"error": code, "message": ...}`` and the remote SDK raises the same class back from ``code``);
messages say what happened, to which object, and what to do next.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "BackendError",
    "BackendUnavailable",
    "CeilingExceeded",
    "CommandError",
    "CommandNotFound",
    "ConfigError",
    "ContextNotFound",
    "CorralError",
    "FileError",
    "DiskFullError",
    "FileNotFound",
    "HostRefused",
    "ImageError",
    "ImageRefused",
    "InterpreterUnavailable",
    "InvalidRequestError",
    "OriginRefused",
    "PathRefused",
    "PolicyError",
    "PortClosed",
    "PortError",
    "PortNotExposed",
    "QuotaExceeded",
    "RequestRefused",
    "SandboxBusy",
    "SandboxError",
    "SandboxExpired",
    "SandboxLost",
    "SandboxNotFound",
    "SnapshotError",
    "SnapshotInUse",
    "SnapshotNotFound",
    "TooLarge",
    "TransportError",
    "UsageError",
    "VolumeError",
    "VolumeInUse",
    "VolumeNotFound",
    "error_class",
]


class CorralError(Exception):
    """Root of every error Corral raises on purpose."""

    code: str = "corral_error"
    status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(CorralError):
    code = "config_error"
    status = 500


class UsageError(CorralError, RuntimeError):
    code = "usage_error"
    status = 400


class InvalidRequestError(UsageError):
    code = "invalid_request"
    status = 422


class SandboxError(CorralError):
    code = "sandbox_error"
    status = 400


class SandboxNotFound(SandboxError):
    code = "sandbox_not_found"
    status = 404


class SandboxExpired(SandboxNotFound):
    code = "sandbox_expired"
    status = 404


class SandboxLost(SandboxError):
    """The cluster node the sandbox lived on died: its processes and workspace are gone; its
    audit trail up to the last event shipped stays readable."""

    code = "sandbox_lost"
    status = 410


class SandboxBusy(SandboxError):
    code = "sandbox_busy"
    status = 409


class SnapshotError(CorralError):
    code = "snapshot_error"
    status = 400


class SnapshotNotFound(SnapshotError):
    code = "snapshot_not_found"
    status = 404


class SnapshotInUse(SnapshotError):
    code = "snapshot_in_use"
    status = 409


class CommandError(CorralError, ValueError):
    code = "command_error"
    status = 400


class CommandNotFound(CorralError):
    code = "command_not_found"
    status = 404


class ContextNotFound(CorralError):
    code = "context_not_found"
    status = 404


class InterpreterUnavailable(CorralError):
    code = "interpreter_unavailable"
    status = 400


class FileError(CorralError):
    code = "file_error"
    status = 400


class PathRefused(FileError, ValueError):
    code = "path_refused"
    status = 400


class FileNotFound(FileError):
    code = "file_not_found"
    status = 404


class BackendError(CorralError):
    code = "backend_error"
    status = 500


class BackendUnavailable(BackendError):
    code = "backend_unavailable"
    status = 503


class DiskFullError(CorralError):
    """The disk that holds the data directory is full. The operation changed nothing (or was
    undone); freeing space (destroying sandboxes, deleting snapshots or volumes, ``corral audit
    prune``), which works on a full disk, lets it succeed."""

    code = "insufficient_storage"
    status = 507


class ImageError(CorralError):
    """An image that could not be fetched (unreachable, unknown, digest mismatch) or whose
    content is refused (a layer escaping its root, an unknown format); nothing of it is kept."""

    code = "image_error"
    status = 422


class PortError(CorralError):
    code = "port_error"
    status = 502


class PortNotExposed(PortError):
    """The port is not exposed (never, or no longer); its owner exposes it with
    ``sb.ports.expose(port)``."""

    code = "port_not_exposed"
    status = 404


class PortClosed(PortError):
    """The port is exposed but nothing in the sandbox accepts connections on it (the server
    is not started yet, crashed, or listens on another port)."""

    code = "port_closed"
    status = 502


class VolumeError(CorralError):
    code = "volume_error"
    status = 400


class VolumeNotFound(VolumeError):
    code = "volume_not_found"
    status = 404


class VolumeInUse(VolumeError):
    """A volume mounted by a sandbox cannot be deleted, and one a sandbox writes cannot be
    mounted by another; the message names the sandbox."""

    code = "volume_in_use"
    status = 409


class PolicyError(CorralError):
    code = "policy_error"
    status = 403


class ImageRefused(PolicyError):
    """The operator's supply-chain policy refuses the image (a registry not on the allowlist,
    a reference without a digest); the message names the setting."""

    code = "image_refused"
    status = 403


class CeilingExceeded(PolicyError):
    """A policy (host, template, tier, secret, lifetime, resources) beyond the operator's ceiling
    for the tenant; the message names the ceiling. Asking again does not help: the operator must
    raise it."""

    code = "ceiling_exceeded"
    status = 403


class QuotaExceeded(PolicyError):
    code = "quota_exceeded"
    status = 429


class TooLarge(QuotaExceeded):
    code = "too_large"
    status = 413


class AuthError(CorralError):
    code = "unauthorized"
    status = 401


class RequestRefused(CorralError):
    code = "request_refused"
    status = 400


class HostRefused(RequestRefused):
    code = "host_refused"
    status = 421


class OriginRefused(RequestRefused):
    code = "origin_refused"
    status = 403


class TransportError(CorralError):
    code = "transport_error"
    status = 502


def error_class(code: str) -> type[CorralError]:
    """The class for a wire ``code`` (the remote SDK raises what the service raised)."""
    for cls in _all_classes():
        if cls.code == code:
            return cls
    return CorralError


def _all_classes() -> list[type[CorralError]]:
    found: list[type[CorralError]] = []
    pending: list[type[CorralError]] = [CorralError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found
