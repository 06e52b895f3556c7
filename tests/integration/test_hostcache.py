"""What a CLI process pays for the tiers it does not use: their host checks are remembered for
the boot (a second process starts no gVisor probe; a new runsc is probed again), recovery
before first use loads no tier the call does not need (the reaper's pass does), and one
tier's sweep leaves another's running sandbox alone. Nothing here is timed:
bench/bench_cli_recovery.py measures the costs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import Sandbox
from corral._control.manager import Manager
from corral._settings import Settings
from tests.conftest import managed, private_settings

pytestmark = pytest.mark.needs_root

# A new process making the gVisor tier ready, as its first sandbox would.
_READY = """
from corral._backends.gvisor import GvisorBackend
from corral._settings import Settings

backend = GvisorBackend(Settings())
try:
    backend._ready()
finally:
    backend.remove_instance()
    backend.close()
"""


@pytest.fixture
def own() -> Iterator[Settings]:
    with private_settings("corral-test-hostcache-") as settings:
        yield settings


@pytest.fixture
def runsc_log(tmp_path: Path, gvisor_problems: list[str]) -> Iterator[tuple[Path, Path]]:
    """A ``runsc`` first on PATH that logs each call and runs the real one: (its bin
    directory, the log)."""
    if gvisor_problems:
        pytest.skip("the gVisor tier cannot run on this host: " + "; ".join(gvisor_problems))
    from corral._backends.gvisor.runsc import find_runsc

    real = find_runsc()
    assert real is not None
    bindir, log = tmp_path / "bin", tmp_path / "runsc.log"
    bindir.mkdir()
    _write_wrapper(bindir / "runsc", real, log)
    yield bindir, log


def _write_wrapper(path: Path, real: str, log: Path) -> None:
    new = path.with_name(".runsc.new")
    new.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    new.chmod(0o755)
    os.replace(new, path)  # as a package upgrade replaces it: a new file


def _env(settings: Settings, bindir: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "CORRAL_HOME": str(settings.home),
           "CORRAL_UID_START": str(settings.uid_start),
           "CORRAL_UID_COUNT": str(settings.uid_count)}
    if bindir is not None:
        env["PATH"] = f"{bindir}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def _probes(log: Path) -> int:
    """How many probe sandboxes runsc was asked to run (container ids ``probe.<pid>...``)."""
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines()
               if " run " in f" {line} " and " probe." in f" {line}")


def _corral(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "corral", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def test_a_second_process_starts_no_probe_and_a_new_runsc_is_probed_again(
        own: Settings, runsc_log: tuple[Path, Path]) -> None:
    bindir, log = runsc_log
    env = _env(own, bindir)

    def ready() -> None:
        done = subprocess.run([sys.executable, "-c", _READY], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr

    ready()
    assert _probes(log) == 1
    record = json.loads((own.home / "hostchecks" / "gvisor.json").read_text())
    assert record["host"]["programs"]["runsc"][0] == str(bindir / "runsc")
    ready()  # the same boot, the same runsc: the pass recorded is enough
    assert _probes(log) == 1
    from corral._backends.gvisor.runsc import find_runsc

    real = find_runsc()
    assert real is not None and real != str(bindir / "runsc")  # (this process's PATH)
    _write_wrapper(bindir / "runsc", real, log)  # an upgrade: same path, another file
    ready()
    assert _probes(log) == 2
    # The operator's tool always runs the real checks.
    _corral(env, "doctor", "--json")
    assert _probes(log) == 3


def _stored(mgr: Manager, isolation: str) -> str:
    """A row of a running sandbox of ``isolation``: what recovery sees in the store (no
    runtime behind it: nothing here may need the tier)."""
    import secrets

    info = mgr.store.insert(sandbox_id=f"sbx_hc{secrets.token_hex(5)}", template="base",
                            resources="small", ttl_s=600, labels={},
                            allocate_uid=mgr.backend.allocate_uid, isolation=isolation)
    mgr.store.set_state(info.id, "running")
    return info.id


def test_first_use_loads_no_tier_the_call_does_not_need(
        own: Settings, runsc_log: tuple[Path, Path]) -> None:
    bindir, log = runsc_log
    env = _env(own, bindir)
    with managed(own) as mgr:
        ids = [_stored(mgr, "gvisor"), _stored(mgr, "microvm")]
        try:
            fresh = Manager(own)  # a new control plane, as each CLI process has
            try:
                assert {info.id for info in fresh.list()} == set(ids)
                assert set(fresh._backends) == {"namespace"}
            finally:
                fresh.close()
            _corral(env, "run", "--", "true")
            listed = _corral(env, "ls", "--json")
            assert {s["id"] for s in json.loads(listed.stdout)} == set(ids)
            # Neither the gVisor nor the microVM tier was checked (nor runsc run at all).
            assert not log.exists()
            assert sorted(p.name for p in (own.home / "hostchecks").iterdir()) == [
                "namespace.json"]
            # The reaper's pass (here `corral reap`) sweeps every tier the store holds.
            mgr.store.delete(ids.pop())  # (the microVM tier may not run on this host)
            _corral(env, "reap", "--json")
            assert _probes(log) == 1
            assert (own.home / "hostchecks" / "gvisor.json").is_file()
        finally:
            for sandbox_id in ids:
                mgr.store.delete(sandbox_id)
            gvisor = mgr._backends.get("gvisor")
            if gvisor is not None:
                gvisor.remove_instance()  # type: ignore[attr-defined]


def _vm_processes(sandbox_id: str) -> set[str]:
    out = subprocess.run(["pgrep", "-af", "qemu-system|microvm.keeper"], capture_output=True,
                         text=True, check=False).stdout
    return {line.split()[0] for line in out.splitlines()
            if sandbox_id in line and "pgrep" not in line}


@pytest.mark.microvm
def test_another_tiers_sweep_leaves_a_running_microvm_alone(
        settings: Settings, home: str, microvm_problems: list[str]) -> None:
    """Every tier's sweep walks every sandbox's cgroups; the namespace tier's once killed the
    microVM tier's ``vm`` group (QEMU) of a live sandbox at every CLI call."""
    if microvm_problems:
        pytest.skip("the microVM tier cannot run here: " + "; ".join(microvm_problems))
    sb = Sandbox.create(home=home, isolation="microvm")
    try:
        assert sb.commands.run("echo up").stdout == "up\n"
        running = _vm_processes(sb.id)
        assert running
        env = _env(settings)
        _corral(env, "ls", "--json")
        _corral(env, "reap", "--json")
        assert _vm_processes(sb.id) == running
    finally:
        sb.kill()
