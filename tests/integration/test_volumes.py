"""Persistent volumes and data mounts through the SDK, embedded and over HTTP: what outlives a
sandbox, one writer or many readers, the quota, the tenant's ownership, the operator's list of
data mounts, and a service killed with SIGKILL while a sandbox has a volume mounted."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from corral import (
    PolicyError,
    QuotaExceeded,
    Sandbox,
    UsageError,
    Volume,
    VolumeInUse,
    VolumeNotFound,
)
from corral._control.tenants import TenantDirectory
from corral._settings import Settings

from ..conftest import managed
from .hostprocs import host_procs_of_uid, status_field
from .servers import Server

pytestmark = pytest.mark.needs_root

ROOT = Path(__file__).resolve().parents[2]


def _name() -> str:
    return f"v{secrets.token_hex(4)}"


@pytest.fixture
def volume(where: dict[str, str]) -> Iterator[str]:
    name = _name()
    Volume.create(name, size="32M", **where)
    yield name
    Volume.delete(name, **where)


def test_a_volume_outlives_its_sandbox(where: dict[str, str], volume: str) -> None:
    with Sandbox.create(volumes={volume: "/mnt/data"}, **where) as first:
        written = first.commands.run("echo kept > /mnt/data/note && id -u && stat -c %U "
                                     "/mnt/data/note")
        assert written.exit_code == 0, written.stderr
        info = Volume.get(volume, **where)
        assert info.mounted_by == [first.id] and info.writer == first.id
    assert Volume.get(volume, **where).mounted_by == []
    with Sandbox.create(volumes={volume: "/workspace/cache"}, **where) as second:
        assert second.commands.run("cat /workspace/cache/note").stdout == "kept\n"
        again = second.commands.run("echo more >> /workspace/cache/note && cat "
                                    "/home/user/cache/note")
        assert again.stdout == "kept\nmore\n", again.stderr
        assert second.get_info().mounts == [{"kind": "volume", "source": Volume.get(
            volume, **where).id, "target": "/workspace/cache", "read_only": False}]
    assert volume in {v.name for v in Volume.list(**where)}


def test_one_writer_or_many_readers(where: dict[str, str], volume: str) -> None:
    with Sandbox.create(volumes={volume: "/mnt/v"}, **where) as writer:
        writer.commands.run("echo w > /mnt/v/f")
        with pytest.raises(VolumeInUse, match="one writer or"):
            Sandbox.create(volumes={volume: "/mnt/v"}, **where)
        with pytest.raises(VolumeInUse):
            Sandbox.create(volumes={volume: {"path": "/mnt/v", "read_only": True}}, **where)
        with pytest.raises(VolumeInUse, match="destroy the sandboxes"):
            Volume.delete(volume, **where)
    readers = [Sandbox.create(volumes={volume: {"path": "/mnt/v", "read_only": True}}, **where)
               for _ in range(2)]
    try:
        for reader in readers:
            assert reader.commands.run("cat /mnt/v/f").stdout == "w\n"
            refused = reader.commands.run("echo x > /mnt/v/f")
            assert refused.exit_code != 0 and "Read-only file system" in refused.stderr
        with pytest.raises(VolumeInUse):
            Sandbox.create(volumes={volume: "/mnt/v"}, **where)
        assert len(Volume.get(volume, **where).mounted_by) == 2
    finally:
        for reader in readers:
            reader.kill()


def test_a_full_volume_is_enospc_inside_and_keeps_what_fit(where: dict[str, str]) -> None:
    name = _name()
    Volume.create(name, size="16M", **where)
    try:
        with Sandbox.create(volumes={name: "/mnt/small"}, **where) as sb:
            # At most 24 MiB into a 16 MiB volume: bounded by construction.
            filled = sb.commands.run("dd if=/dev/zero of=/mnt/small/fill bs=1M count=24 "
                                     "2>&1; echo small > /mnt/small/after; df -k /mnt/small")
            assert "No space left on device" in filled.stdout, filled.stdout
            used = Volume.get(name, **where).used_bytes
            assert used is not None and used > 8 << 20
    finally:
        Volume.delete(name, **where)


def test_bad_volume_requests_are_refused_precisely(where: dict[str, str], volume: str) -> None:
    with pytest.raises(VolumeNotFound):
        Sandbox.create(volumes={"no-such-volume": "/mnt/x"}, **where)
    for bad in ("/etc/x", "/mnt", "/mnt/../etc", "relative", "/workspace", "/mnt/a//b"):
        with pytest.raises(UsageError):
            Sandbox.create(volumes={volume: bad}, **where)
    with pytest.raises(UsageError, match="overlap"):
        Sandbox.create(volumes={volume: "/mnt/a"}, data_mounts={"x": "/mnt/a/b"}, **where)
    for size in ("1K", "lots", -5, 2**62):
        with pytest.raises(UsageError):
            Volume.create(_name(), size=size, **where)
    with pytest.raises(UsageError, match="already exists"):
        Volume.create(volume, size="16M", **where)
    with pytest.raises(VolumeNotFound):
        Volume.delete("no-such-volume", **where)
    assert Volume.get(volume, **where).mounted_by == []  # nothing half-made is left holding it


def test_data_mounts_come_only_from_the_operators_list(where: dict[str, str]) -> None:
    with pytest.raises(PolicyError, match="CORRAL_DATA_MOUNTS"):
        Sandbox.create(data_mounts={"etc": "/mnt/etc"}, **where)


def test_a_fork_gets_the_read_only_mounts_only(home: str) -> None:
    name = _name()
    Volume.create(name, size="16M", home=home)
    try:
        with Sandbox.create(volumes={name: "/mnt/w"}, home=home) as parent:
            parent.commands.run("echo parent > /mnt/w/f")
            (child,) = parent.fork()
            with child:
                assert child.get_info().mounts == []
                assert child.commands.run("test -e /mnt/w/f").exit_code != 0
    finally:
        Volume.delete(name, home=home)


# -- the operator's data mounts, tenants, a crash ----------------------------------------------


@pytest.fixture(scope="module")
def data_home() -> Iterator[tuple[Settings, Path]]:
    home = Path(tempfile.mkdtemp(prefix="corral-test-volumes-"))
    home.chmod(0o711)
    data = Path(tempfile.mkdtemp(prefix="corral-test-data-"))
    data.chmod(0o755)
    (data / "readme.txt").write_text("shared data\n")
    (data / "readme.txt").chmod(0o644)
    secret = Path(tempfile.mkdtemp(prefix="corral-test-secret-"))
    (secret / "host-only").write_text("host secret\n")
    (data / "escape").symlink_to(secret / "host-only")
    settings = Settings(home=home, uid_start=2_110_000_000 + secrets.randbelow(100) * 1000,
                        uid_count=1000, data_mounts={"refs": data})
    yield settings, data
    for path in (home, data, secret):
        shutil.rmtree(path, ignore_errors=True)


def test_a_data_mount_is_read_only_and_its_links_never_reach_the_host(
        data_home: tuple[Settings, Path]) -> None:
    settings, _ = data_home
    with managed(settings) as mgr:
        info = mgr.create(data_mounts={"refs": "/mnt/refs"})
        try:
            read = mgr.run(info.id, "cat /mnt/refs/readme.txt")
            assert read.stdout == "shared data\n"
            write = mgr.run(info.id, "echo x > /mnt/refs/new")
            assert write.exit_code != 0
            escaped = mgr.run(info.id, "cat /mnt/refs/escape")
            assert "host secret" not in escaped.stdout and escaped.exit_code != 0
        finally:
            mgr.destroy(info.id)
        with pytest.raises(UsageError, match="read-only"):
            mgr.create(data_mounts={"refs": {"path": "/mnt/refs", "read_only": False}})


def test_a_data_mount_keeps_the_sandboxs_resident_from_command_to_command(
        data_home: tuple[Settings, Path]) -> None:
    """A data mount is a bind of a directory of the host's filesystem, with its parent's
    device: the check that closes a resident whose mounts went away asks the kernel (statx)
    whether it is a mount, so the resident is kept, not replaced before every command."""
    settings, _ = data_home
    with managed(settings) as mgr:
        info = mgr.create(data_mounts={"refs": "/mnt/refs"})
        try:
            uid = mgr.store.get(info.id).uid
            zygotes = []
            for _ in range(4):  # the first takes a bwrap of its own; the rest the resident
                assert mgr.run(info.id, "cat /mnt/refs/readme.txt").stdout == "shared data\n"
                zygotes.append({pid for pid, st in host_procs_of_uid(uid)
                                if status_field(st, "Name") == "zygote"})
            assert len(zygotes[1]) == 1 and zygotes[1] == zygotes[2] == zygotes[3], zygotes
        finally:
            mgr.destroy(info.id)


def test_a_volume_is_its_tenants_own(data_home: tuple[Settings, Path]) -> None:
    settings, _ = data_home
    with managed(settings) as mgr:
        directory = TenantDirectory(mgr.store)
        for tenant in ("alpha", "beta"):
            directory.add_tenant(tenant, max_sandboxes=3, tiers=["small"],
                                 commands_per_minute=100)
        keys = {t: directory.create_key(t)[1] for t in ("alpha", "beta")}
        with Server(mgr) as srv:
            Volume.create("shared-name", size="16M", url=srv.url, api_key=keys["alpha"])
            # The same name is another volume for another tenant; alpha's is not beta's.
            with pytest.raises(VolumeNotFound):
                Volume.get("shared-name", url=srv.url, api_key=keys["beta"])
            with pytest.raises(VolumeNotFound):
                Sandbox.create(volumes={"shared-name": "/mnt/x"}, url=srv.url,
                               api_key=keys["beta"])
            assert Volume.list(url=srv.url, api_key=keys["beta"]) == []
            answer = httpx.delete(f"{srv.url}/v1/volumes/shared-name",
                                  headers={"Authorization": f"Bearer {keys['beta']}"})
            assert answer.status_code == 404
            Volume.delete("shared-name", url=srv.url, api_key=keys["alpha"])


_SERVICE = textwrap.dedent("""
    import sys
    from corral._control.manager import Manager
    from corral._settings import Settings

    settings = Settings(home=sys.argv[1], uid_start=int(sys.argv[2]), uid_count=1000)
    manager = Manager(settings)
    manager.volumes.create("durable", "32M")
    info = manager.create(volumes={"durable": "/mnt/d"}, timeout=600)
    # Written, not synced: the page cache of the host kernel holds it, as it would when a
    # service dies mid-work.
    result = manager.run(info.id, "head -c 5000000 /dev/urandom > /mnt/d/blob && "
                                  "sha256sum /mnt/d/blob")
    print(info.id, result.stdout.split()[0], flush=True)
    import time
    time.sleep(600)
""")


def test_a_service_killed_with_a_volume_mounted_loses_nothing(
        data_home: tuple[Settings, Path]) -> None:
    base, _ = data_home
    home = Path(tempfile.mkdtemp(prefix="corral-test-volcrash-"))
    home.chmod(0o711)
    uid_start = base.uid_start + 500 if base.uid_start + 1500 < 2**31 else base.uid_start - 1000
    settings = Settings(home=home, uid_start=uid_start, uid_count=1000)
    child = subprocess.Popen([sys.executable, "-c", _SERVICE, str(home), str(uid_start)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert len(line) == 2, "the service did not get as far as writing"
        sandbox_id, digest = line
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    try:
        with managed(settings) as mgr:
            mgr.recover()
            # The sandbox outlived its service, with its volume mounted; its data is intact.
            again = mgr.run(sandbox_id, "sha256sum /mnt/d/blob")
            assert again.stdout.split()[0] == digest
            mgr.destroy(sandbox_id)
            fresh = mgr.create(volumes={"durable": "/mnt/d"})
            assert mgr.run(fresh.id, "sha256sum /mnt/d/blob").stdout.split()[0] == digest
            mgr.destroy(fresh.id)
            mgr.volumes.delete("durable")
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_tenant_s_volumes_are_counted_against_its_quota(
        data_home: tuple[Settings, Path]) -> None:
    base, _ = data_home
    settings = base.model_copy(update={"volumes_per_tenant": 2,
                                       "volume_bytes_per_tenant": 48 << 20})
    with managed(settings) as mgr:
        mgr.volumes.create("one", "16M", tenant="alpha")
        with pytest.raises(QuotaExceeded, match="CORRAL_VOLUME_BYTES_PER_TENANT"):
            mgr.volumes.create("too-big", "40M", tenant="alpha")
        mgr.volumes.create("two", "16M", tenant="alpha")
        with pytest.raises(QuotaExceeded, match="CORRAL_VOLUMES_PER_TENANT"):
            mgr.volumes.create("three", "16M", tenant="alpha")
        mgr.volumes.create("three", "16M", tenant="beta")  # another tenant's own count
        assert {v.name for v in mgr.volumes.list(tenant="alpha")} == {"one", "two"}
        mgr.volumes.delete("one", tenant="alpha")
        mgr.volumes.create("three", "16M", tenant="alpha")  # room again
        for tenant in ("alpha", "beta"):
            for volume in mgr.volumes.list(tenant=tenant):
                mgr.volumes.delete(volume.id, tenant=tenant)
