"""The per-stream cap: what the live callback and the result see when output is cut."""

from __future__ import annotations

from corral._backends._linux.notfound import ExecFailureHead
from corral._backends._linux.process_io import OutputStream


def test_the_live_reader_is_told_the_moment_output_is_cut() -> None:
    live: list[str] = []
    out = OutputStream("stdout", 10, live.append)
    out.feed(b"12345")
    assert live == ["12345"]
    out.feed(b"6789abcdef")
    marker = "[corral: stdout truncated after 10 bytes; the rest is dropped]\n"
    assert live[-1] == "\n" + marker  # at once, not at the end
    out.feed(b"more")
    assert len(live) == 3  # told once
    text = out.finish()
    assert text == "".join(live) == "123456789a\n" + marker
    assert out.dropped == 5 + 4 and out.kept == 10


def test_a_cut_on_a_line_end_adds_no_blank_line_and_a_zero_cap_still_says_so() -> None:
    out = OutputStream("stderr", 3, None)
    out.feed(b"ab\nc")
    assert out.finish() == "ab\n[corral: stderr truncated after 3 bytes; the rest is dropped]\n"
    empty = OutputStream("stdout", 0, None)
    empty.feed(b"x")
    assert empty.finish().startswith("[corral: stdout truncated after 0 bytes")


def test_a_runtime_report_on_an_unstartable_program_becomes_one_plain_line() -> None:
    def reason(line: str) -> str | None:
        return line.rsplit(": ", 1)[-1] if line.startswith("bwrap: execvp ") else None

    head = ExecFailureHead("nosuch", b"bwrap: execvp ", reason)
    live: list[str] = []
    err = OutputStream("stderr", 1000, live.append, head=head)
    err.feed(b"bwrap: exe")
    assert live == []  # held until it is whole
    err.feed(b"cvp nosuch: No such file or directory\n")
    assert err.finish() == "".join(live) == "corral: command not found: nosuch\n"
    assert head.exit_code == 127


def test_other_output_passes_the_head_untouched() -> None:
    head = ExecFailureHead("p", b"bwrap: execvp ", lambda _line: None)
    live: list[str] = []
    err = OutputStream("stderr", 1000, live.append, head=head)
    err.feed(b"bw")
    err.feed(b"ok then\n")
    assert live == ["bwok then\n"] and head.exit_code is None
    partial = OutputStream("stderr", 1000, None,
                           head=ExecFailureHead("p", b"bwrap: execvp ", lambda _l: "x"))
    partial.feed(b"bwrap: execvp p: No such")  # the stream ends mid-line: passed as it was
    assert partial.finish() == "bwrap: execvp p: No such"


def test_past_the_limit_a_long_lived_reader_still_gets_every_byte_and_no_notice() -> None:
    # A kernel's protocol runs over its stdout for hours: the tier's cap must cut the
    # result only, never the live stream (nor insert its notice into it).
    live: list[str] = []
    out = OutputStream("stdout", 10, live.append, stream_past_limit=True)
    out.feed(b"0123456789ab")
    out.feed("é".encode()[:1])  # a character split across reads stays whole
    out.feed("é".encode()[1:] + b"\n")
    text = out.finish()
    assert "".join(live) == "0123456789abé\n"
    assert text.startswith("0123456789\n[corral: stdout truncated after 10 bytes")
    assert out.kept == 10 and out.dropped == 5


def test_a_lossless_reader_gets_the_exact_bytes_and_the_result_stays_readable() -> None:
    live: list[str] = []
    out = OutputStream("stdout", 1 << 20, live.append, lossless=True)
    written = [b"\xff\x00a\xc3", b"\xa9\x80", bytes(range(256))]  # é split across two chunks
    for chunk in written:
        out.feed(chunk)
    text = out.finish()
    assert "".join(live).encode("utf-8", "surrogateescape") == b"".join(written)
    assert "\ufffd" in text and "é" in text
    text.encode("utf-8")  # the result takes any encoder: no lone surrogate in it


def test_a_lossless_reader_of_a_cut_stream_gets_exactly_the_kept_bytes() -> None:
    live: list[str] = []
    out = OutputStream("stdout", 4, live.append, lossless=True)
    out.feed(b"ab\xfe\xffcd")
    out.finish()
    assert live[0].encode("utf-8", "surrogateescape") == b"ab\xfe\xff"
    assert live[1].startswith("\n[corral: stdout truncated after 4 bytes")
