"""Every error Corral raises on purpose.

The tree::

    CorralError
    ├── ConfigError            settings or host configuration is wrong
    ├── UsageError             the caller misused an object (also a RuntimeError)
    ├── SandboxError
    │   ├── SandboxNotFound
    │   ├── SandboxExpired     its TTL has passed; it has been destroyed
    │   └── SandboxBusy        being created or destroyed by someone else
    ├── CommandError           a command could not be started (bad argv, cwd, env)
    ├── FileError              a file operation failed
    │   ├── PathRefused        the path leaves /workspace (.., absolute, symlink)
    │   └── FileNotFound
    ├── BackendError           the isolation backend failed
    │   └── BackendUnavailable a kernel feature or host tool is missing
    └── PolicyError
        └── QuotaExceeded      no free uid, too large a file, ...

Each class carries a stable ``code`` (used by the CLI's ``--json`` output and, later, the HTTP API)
and messages say what happened, to which object, and what to do next.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "CommandError",
    "ConfigError",
    "CorralError",
    "FileError",
    "FileNotFound",
    "PathRefused",
    "PolicyError",
    "QuotaExceeded",
    "SandboxBusy",
    "SandboxError",
    "SandboxExpired",
    "SandboxNotFound",
    "UsageError",
]


class CorralError(Exception):
    """Root of every error Corral raises on purpose."""

    code: str = "corral_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(CorralError):
    code = "config_error"


class UsageError(CorralError, RuntimeError):
    code = "usage_error"


class SandboxError(CorralError):
    code = "sandbox_error"


class SandboxNotFound(SandboxError):
    code = "sandbox_not_found"


class SandboxExpired(SandboxNotFound):
    code = "sandbox_expired"


class SandboxBusy(SandboxError):
    code = "sandbox_busy"


class CommandError(CorralError, ValueError):
    code = "command_error"


class FileError(CorralError):
    code = "file_error"


class PathRefused(FileError, ValueError):
    code = "path_refused"


class FileNotFound(FileError):
    code = "file_not_found"


class BackendError(CorralError):
    code = "backend_error"


class BackendUnavailable(BackendError):
    code = "backend_unavailable"


class PolicyError(CorralError):
    code = "policy_error"


class QuotaExceeded(PolicyError):
    code = "quota_exceeded"
