"""Stop-string matching over incrementally produced text."""
from __future__ import annotations


def find_stop_string(text: str, num_new_chars: int, stops: list[str]
                     ) -> tuple[str, int] | None:
    """Find the earliest stop string that ends inside the last num_new_chars of text.

    Only the new tail (plus the longest stop's length of context, so matches
    spanning token boundaries are found) is searched. Returns (stop, start index).
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best


def held_back_chars(stops: list[str]) -> int:
    """Characters a stream must hold back: the end of the text may be a stop's prefix."""
    return max((len(s) for s in stops), default=1) - 1
