"""Audit shipping (``_cluster.audit``) without Ray: the sink appends only at the offset it
holds (a resend or a second shipper never duplicates a line), the shipper sends complete lines
only and resumes where the sink is."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral._cluster.audit import AuditSink, Shipper


def test_the_sink_appends_only_where_its_copy_ends(tmp_path: Path) -> None:
    sink = AuditSink(str(tmp_path / "sink"))
    assert sink.append("sbx_a", 0, b"one\n") == 4
    assert sink.append("sbx_a", 0, b"one\n") == 4  # a resend: ignored
    assert sink.append("sbx_a", 9, b"late\n") == 4  # a gap: ignored, the shipper realigns
    assert sink.append("sbx_a", 4, b"two\n") == 8
    assert (tmp_path / "sink" / "sbx_a.jsonl").read_bytes() == b"one\ntwo\n"
    assert sink.size("sbx_none") == 0
    for bad in ("", "../x", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            sink.append(bad, 0, b"x\n")


def test_the_shipper_sends_complete_lines_and_resumes(tmp_path: Path) -> None:
    logs = tmp_path / "audit"
    logs.mkdir()
    sink = AuditSink(str(tmp_path / "sink"))
    sink.append("sbx_b", 0, b"old\n")  # shipped by an earlier run of this node
    (logs / "sbx_b.jsonl").write_bytes(b"old\nnew\nhalf")
    shipper = Shipper(logs, sink.append, sink.size, interval_s=3600)
    try:
        shipper.ship()
        assert (tmp_path / "sink" / "sbx_b.jsonl").read_bytes() == b"old\nnew\n"
        with open(logs / "sbx_b.jsonl", "ab") as f:
            f.write(b"-done\n")
        shipper.ship()
        shipper.ship()  # nothing new: nothing sent twice
        assert (tmp_path / "sink" / "sbx_b.jsonl").read_bytes() == b"old\nnew\nhalf-done\n"
    finally:
        shipper.close()
