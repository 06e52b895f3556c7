"""The store hands back what it wrote, and remembers what never changes."""

from __future__ import annotations

from pathlib import Path

from corral._control.store import Store


def _insert(store: Store, sandbox_id: str, **extra: object) -> object:
    return store.insert(sandbox_id=sandbox_id, template="base", resources="small", ttl_s=60.0,
                        labels={"team": "a"}, allocate_uid=lambda taken: 1000 + len(taken),
                        **extra)  # type: ignore[arg-type]


def test_an_insert_returns_the_row_as_a_read_returns_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "corral.db")
    plain = _insert(store, "sbx_plain")
    assert plain == store.get("sbx_plain")
    full = _insert(store, "sbx_full", network={"mode": "allowlist", "allow": ["x.test"]},
                   secrets={"TOKEN": "corral-ph-1"}, tenant="t1", idle_timeout=30.0,
                   isolation="gvisor", template_version="v1",
                   mounts=[{"kind": "data", "source": "/srv/d", "target": "/mnt/d",
                            "read_only": True}])
    assert full == store.get("sbx_full")


def test_placeholders_are_the_sandboxs_own_and_none_once_it_is_deleted(tmp_path: Path) -> None:
    store = Store(tmp_path / "corral.db")
    _insert(store, "sbx_a", secrets={"TOKEN": "corral-ph-a"})
    _insert(store, "sbx_b")
    assert store.placeholders("sbx_a") == ["corral-ph-a"]
    assert store.placeholders("sbx_b") == []
    # Another process's view (a store that did not insert them) reads the same.
    other = Store(tmp_path / "corral.db")
    assert other.placeholders("sbx_a") == ["corral-ph-a"]
    store.delete("sbx_a")
    assert store.placeholders("sbx_a") == []
    assert store.placeholders("sbx_never") == []
