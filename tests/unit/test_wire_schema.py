"""One wire schema: the public models are what the server sends and what the SDK parses; the
store's record is a separate type, converted once."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from corral import SandboxInfo, SnapshotInfo
from corral._control.records import SandboxRecord

_WIRE = {"id": "sbx_0123456789ab", "template": "base", "resources": "small",
         "state": "running", "created_at": 1.0, "expires_at": 2.0, "labels": {"a": "b"},
         "network": {"mode": "none"}, "secrets": ["TOKEN"], "idle_timeout": None,
         "isolation": "gvisor", "layer": None, "memory_image": None,
         "template_version": None, "mounts": [],
         "lifecycle": {"on_timeout": "kill", "auto_resume": False, "on_idle": "destroy",
                       "hibernate_after": None},
         "sleeping_since": None}


def test_the_public_sandbox_has_nothing_of_the_operator() -> None:
    assert not {"uid", "last_active", "tenant"} & set(SandboxInfo.model_fields)
    assert SandboxInfo.model_fields["secrets"].annotation == list[str]  # names, no placeholders


def test_the_sdk_ignores_fields_a_newer_server_adds_and_defaults_what_an_older_one_lacks() -> None:
    newer = SandboxInfo.model_validate({**_WIRE, "region": "eu-1"})
    assert newer.to_dict() == _WIRE
    older = {k: v for k, v in _WIRE.items()
             if k not in ("isolation", "layer", "memory_image", "template_version", "mounts",
                          "lifecycle", "sleeping_since")}
    parsed = SandboxInfo.model_validate(older)
    assert (parsed.isolation, parsed.layer, parsed.memory_image, parsed.template_version) == \
        ("namespace", None, None, None)
    assert parsed.lifecycle.on_timeout == "kill"  # an older server killed at the timeout
    assert parsed.sleeping_since is None
    with pytest.raises(ValidationError):
        SandboxInfo.model_validate({**_WIRE, "state": "exploded"})


def test_the_record_converts_once_with_secret_names_only() -> None:
    record = SandboxRecord(id="sbx_0123456789ab", template="base", resources="small",
                           state="running", created_at=1.0, expires_at=2.0, uid=2_100_000_001,
                           labels={"a": "b"}, network={"mode": "none"},
                           secrets={"TOKEN": "CORRAL_PLACEHOLDER_x"}, tenant="acme",
                           last_active=1.5, isolation="gvisor")
    info = record.public()
    assert info.to_dict() == _WIRE
    assert "CORRAL_PLACEHOLDER_x" not in str(info.to_dict())
    with pytest.raises(ValidationError):  # frozen, like the dataclasses it replaces
        info.state = "paused"  # type: ignore[misc]
    assert dataclasses.is_dataclass(record)


def test_a_snapshot_on_the_wire_has_its_eight_fields() -> None:
    snap = SnapshotInfo(id="snap_0123456789ab", name=None, sandbox="sbx_0123456789ab",
                        template="base", created_at=1.0, size_bytes=0, depth=1)
    assert set(snap.to_dict()) == {"id", "name", "sandbox", "template", "created_at",
                                   "size_bytes", "depth", "memory"}
    # An older server's answer has no ``memory``: every snapshot it made is a disk one.
    assert snap.memory is False
