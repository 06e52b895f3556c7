"""The public surface is deliberate: a change to it must show up here in review."""

from __future__ import annotations

import corral
from corral import errors

PUBLIC = [
    "AsyncSandbox",
    "Audit", "AuditEvent", "AuditTrail", "Network", "read_audit", "AuthError", "TooLarge",
    "TransportError", "CommandNotFound",
    "BackendError", "BackendUnavailable", "CommandError", "CommandResult", "Commands",
    "ConfigError", "CorralError", "FileEntry", "FileError", "FileNotFound", "Files", "PathRefused",
    "PolicyError", "QuotaExceeded", "ResourceTier", "Sandbox", "SandboxBusy", "SandboxError",
    "SandboxExpired", "SandboxInfo", "SandboxNotFound", "Usage", "UsageError", "__version__",
    "SnapshotError", "SnapshotInUse", "SnapshotInfo", "SnapshotNotFound",
    "CeilingExceeded", "HostRefused", "OriginRefused", "RequestRefused",
    # issue 12: background processes on both façades, the async audit reader, the live cut
    # notice handed to output callbacks
    "AsyncProcess", "Process", "aread_audit", "OutputCut",
    # issue 13: the code interpreter's results, contexts and errors
    "CodeContext", "Execution", "ExecutionError", "Logs", "OutputMessage", "Result",
    "ContextNotFound", "InterpreterUnavailable",
    # issue 16: exposed ports and persistent volumes
    "AsyncVolume", "Volume", "PortInfo", "VolumeInfo", "PortError", "PortNotExposed",
    "PortClosed", "VolumeError", "VolumeNotFound", "VolumeInUse",
    # issue 17: fan-out over a cluster (or one host), and a sandbox lost with its node
    "AsyncFanOut", "FanOut", "Rollout", "SandboxLost",
    # issue 36: a full data disk, refused the same way on every surface (HTTP 507)
    "DiskFullError",
    # issue 39: a request of the wrong shape, refused the same way on every surface (422)
    "InvalidRequestError",
    # issue 40: what happens at a sandbox's timeout, and to a call that finds it paused
    "Lifecycle",
]


def test_all_matches_the_snapshot() -> None:
    assert sorted(corral.__all__) == sorted(PUBLIC)


def test_every_exported_name_exists() -> None:
    for name in corral.__all__:
        assert hasattr(corral, name), name


def test_every_error_derives_from_the_root_and_has_a_unique_code() -> None:
    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    codes = set()
    for cls in classes:
        assert issubclass(cls, errors.CorralError)
        assert cls.__name__.endswith(("Error", "NotFound", "Expired", "Busy", "Refused",
                                      "Exceeded", "Unavailable", "TooLarge", "InUse", "NotExposed",
                                      "Closed", "Lost"))
        assert 400 <= cls.status < 600
        assert errors.error_class(cls.code) is cls  # the remote SDK raises the same class
        codes.add(cls.code)
    assert len(codes) == len(classes)
