"""Lines out of a stream a tenant can write to, in linear time and bounded memory.

A sandbox's output arrives in chunks; a reader that appends each chunk to what it holds and
splits the whole again costs time quadratic in a line's length, and holds the line, however
long. ``LineSplitter`` looks for newlines in the new chunk only, joins a line's chunks once,
and holds at most ``limit`` characters: a longer line is dropped, up to its next newline, and
said so once (``Overflow``), so a reader can report it instead of waiting for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["LineSplitter", "Overflow"]


@dataclass(frozen=True, slots=True)
class Overflow:
    """A line passed ``limit`` characters: it is dropped up to its next newline."""

    limit: int


class LineSplitter:
    """Feed it text; it yields each complete line (without its newline) and an ``Overflow``
    for each line too long to keep. Every character is searched once and copied at most
    twice (into its chunk's slice, then into its line)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: list[str] = []  # the unfinished line, in pieces
        self._size = 0
        self._dropping = False  # inside a line that went over the limit

    @property
    def held(self) -> int:
        """How many characters of an unfinished line are held (never more than ``limit``)."""
        return self._size

    def feed(self, text: str) -> Iterator[str | Overflow]:
        start = 0
        while (end := text.find("\n", start)) >= 0:
            yield from self._finish(text[start:end])
            start = end + 1
        yield from self._hold(text[start:])

    def gap(self) -> None:
        """Part of the stream was lost: the line under way is not whole. It is dropped, up to
        the next newline, without an ``Overflow`` (the caller knows what it lost)."""
        self._reset()
        self._dropping = True

    def _finish(self, tail: str) -> Iterator[str | Overflow]:
        # The state is reset before the line goes out: a caller that stops iterating (or
        # raises) mid-chunk leaves no piece of this line to prefix the next one.
        line: str | Overflow | None = None
        if self._dropping:
            self._dropping = False  # its newline: the next line starts clean
        elif self._size + len(tail) > self.limit:
            line = Overflow(self.limit)
        elif self._parts:
            self._parts.append(tail)
            line = "".join(self._parts)
        else:
            line = tail
        self._reset()
        if line is not None:
            yield line

    def _hold(self, piece: str) -> Iterator[Overflow]:
        if self._dropping or not piece:
            return
        if self._size + len(piece) > self.limit:
            self._reset()
            self._dropping = True
            yield Overflow(self.limit)
            return
        self._parts.append(piece)
        self._size += len(piece)

    def _reset(self) -> None:
        self._parts = []
        self._size = 0
