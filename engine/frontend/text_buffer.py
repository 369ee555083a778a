"""TextBuffer: a sequence's output text, appended one token's piece at a time.

The text was one string grown with `+=` while another reference held it, so every
token copied the whole output so far: quadratic in its length. Here an append is
amortized O(1), the reads a step needs (the stop-string window at the end, the part of
a stream not yet sent) cost what they return, and the whole text is joined only when
asked for (a final or cumulative output), then kept as one piece.
"""
from __future__ import annotations


class TextBuffer:
    __slots__ = ("_pieces", "_length")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def append(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._length += len(text)

    def slice(self, start: int, end: int | None = None) -> str:
        """text[start:end] (end: the whole length), reading pieces from the end back to
        start: a read near the end touches only the last pieces."""
        end = self._length if end is None else min(end, self._length)
        if start >= end:
            return ""
        out: list[str] = []
        at = self._length  # where the piece being read ends
        for piece in reversed(self._pieces):
            begin = at - len(piece)
            if begin < end:
                out.append(piece[max(0, start - begin):end - begin])
            if begin <= start:
                break
            at = begin
        return "".join(reversed(out))

    def tail(self, count: int) -> str:
        """The last `count` characters."""
        return self.slice(max(0, self._length - count))

    def truncate(self, end: int) -> None:
        """Keep text[:end]."""
        if end < self._length:
            self._pieces = [self.slice(0, end)] if end > 0 else []
            self._length = max(0, end)

    def value(self) -> str:
        """The whole text (joined once, then kept as one piece)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
