"""The splitter the host reads a kernel's protocol stream with (``_control.lines``): lines
exact around its bound, the memory it holds bounded, the work it does linear in its input."""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from typing import SupportsIndex

import pytest

from corral._control.lines import LineSplitter, Overflow

LIMIT = 1000


def split(chunks: Sequence[str], limit: int = LIMIT) -> list[str | Overflow]:
    splitter = LineSplitter(limit)
    return [item for chunk in chunks for item in splitter.feed(chunk)]


def chunked(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 40)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_lines_up_to_the_limit_are_exact_and_longer_ones_are_reported_once() -> None:
    stream = ("a" * (LIMIT - 1) + "\n" + "b" * LIMIT + "\n" + "c" * (LIMIT + 1) + "\n"
              + "after\n" + "\n" + "é" * LIMIT + "\n")
    expected: list[str | Overflow] = ["a" * (LIMIT - 1), "b" * LIMIT, Overflow(LIMIT),
                                      "after", "", "é" * LIMIT]
    assert split([stream]) == expected
    assert split(list(stream)) == expected  # a character at a time
    rng = random.Random(7)
    for _ in range(50):  # and cut anywhere
        assert split(chunked(stream, rng)) == expected


def test_an_overlong_line_is_dropped_up_to_its_next_newline_only() -> None:
    splitter = LineSplitter(LIMIT)
    out: list[str | Overflow] = []
    for _ in range(100):  # 100x the limit, no newline: one report, nothing held
        out += splitter.feed("x" * LIMIT)
        assert splitter.held <= LIMIT
    assert out == [Overflow(LIMIT)]
    assert splitter.held == 0
    assert list(splitter.feed('xx\n{"ev": "end"}\n')) == ['{"ev": "end"}']


def test_the_unfinished_line_held_never_passes_the_limit() -> None:
    splitter = LineSplitter(LIMIT)
    rng = random.Random(11)
    for _ in range(2000):
        piece = "".join(rng.choice("ab\n") if rng.random() < 0.01 else "a"
                        for _ in range(rng.randrange(1, 300)))
        for item in splitter.feed(piece):
            assert isinstance(item, Overflow) or len(item) <= LIMIT
        assert splitter.held <= LIMIT


def test_a_gap_drops_the_broken_line_without_a_report() -> None:
    splitter = LineSplitter(LIMIT)
    assert list(splitter.feed('{"ev": "stdout", "te')) == []
    splitter.gap()
    assert list(splitter.feed('xt": "lost"}\n{"ev": "end"}\n')) == ['{"ev": "end"}']


def test_a_reader_that_stops_mid_chunk_leaves_nothing_of_the_line_behind() -> None:
    splitter = LineSplitter(LIMIT)
    lines = splitter.feed("par")
    assert list(lines) == []
    first = splitter.feed("t one\nlost\n")
    assert next(first) == "part one"
    del first  # abandoned (the reader raised): "lost" is gone, nothing of it is held
    assert list(splitter.feed("two\n")) == ["two"]


class CountingText(str):
    """A chunk that counts the characters ``find`` looks at."""

    searched = 0

    def find(self, sub: str, start: SupportsIndex | None = None,
             end: SupportsIndex | None = None, /) -> int:
        begin = operator.index(start or 0)
        found = super().find(sub, begin, end)
        CountingText.searched += (len(self) if found < 0 else found + 1) - begin
        return found


@pytest.mark.parametrize("lines", [True, False])
def test_every_character_is_searched_once(lines: bool) -> None:
    # The old reader split everything it held again on every chunk: a line of n characters in
    # chunks of c cost n*n/c. Here the work is the input's length, however it is cut.
    CountingText.searched = 0
    block = "x" * 4095 + ("\n" if lines else "x")
    chunks = [CountingText(block) for _ in range(2000)]  # 8 MiB, a line far over the limit
    items = split(chunks, limit=64 * 1024)
    assert CountingText.searched == 2000 * 4096
    if lines:
        assert items == ["x" * 4095] * 2000
    else:
        assert items == [Overflow(64 * 1024)]
