"""Suffix matching over token buffers, shared by the proposers.

A proposal starts from the longest suffix of a request's context that occurred before
(in its own prompt and output, or in the responses of earlier requests), then follows
what came after those occurrences. The occurrences are found with numpy over the
buffer (a request's context: a few thousand tokens) or through a per-token position
index (the responses of many requests), so no tree of Python objects is built: a
suffix tree of depth D holds D nodes per token, megabytes for one long prompt.
Following the occurrences token by token gives exactly the counts a depth-limited
suffix tree would hold (how often each continuation followed the matched text).
"""
from __future__ import annotations

import numpy as np

SEPARATOR = -1  # between two responses in a shared buffer: no match crosses it


class TokenBuffer:
    """A growable int64 array of tokens (amortised appends)."""

    def __init__(self, capacity: int = 256) -> None:
        self.data = np.empty(capacity, dtype=np.int64)
        self.size = 0

    def extend(self, tokens) -> None:
        n = len(tokens)
        if self.size + n > self.data.shape[0]:
            grown = np.empty(max(2 * self.data.shape[0], self.size + n), dtype=np.int64)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.data[self.size:self.size + n] = tokens
        self.size += n

    def view(self) -> np.ndarray:
        return self.data[:self.size]


def longest_match(buf: np.ndarray, candidates: np.ndarray, pattern: list[int],
                  max_len: int) -> tuple[int, np.ndarray]:
    """(m, ends): the longest m <= max_len for which pattern's last m tokens occur in buf
    ending at some of `candidates` (positions already holding pattern[-1]), and those
    end positions."""
    if candidates.size == 0 or not pattern:
        return 0, candidates[:0]
    best, m = candidates, 1
    for j in range(2, min(max_len, len(pattern)) + 1):
        starts = candidates - (j - 1)
        keep = starts >= 0
        candidates = candidates[keep]
        candidates = candidates[buf[starts[keep]] == pattern[-j]]
        if candidates.size == 0:
            break
        best, m = candidates, j
    return m, best


def follow(buf: np.ndarray, ends: np.ndarray, max_tokens: int,
           min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation of the occurrences ending at `ends`, token by
    token, while its estimated probability (the share of occurrences that went on with
    it, multiplied along the way) stays >= min_prob; returns it and its score (the sum
    of those probabilities: the tokens expected to be accepted)."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    n = buf.shape[0]
    while len(tokens) < max_tokens and ends.size:
        total = ends.size
        nxt = ends + 1
        nxt = nxt[nxt < n]
        following = buf[nxt]
        live = following != SEPARATOR
        nxt, following = nxt[live], following[live]
        if following.size == 0:
            break
        values, counts = np.unique(following, return_counts=True)
        top = int(counts.argmax())
        share = counts[top] / total
        if prob * share < min_prob:
            break
        prob *= share
        score += prob
        tokens.append(int(values[top]))
        ends = nxt[following == values[top]]
    return tokens, score


class ResponseIndex:
    """Responses of finished requests, newest last, in one buffer with a position index
    per token pair (a single common token would list most of the buffer); the oldest go
    once more than max_responses are held."""

    def __init__(self, max_responses: int) -> None:
        self.max_responses = max_responses
        self.buffer = TokenBuffer()
        self.positions: dict[tuple[int, int], list[int]] = {}  # pair -> its second's
        self.starts: list[int] = []  # where each held response begins
        self.first = 0  # index in starts of the oldest response still held

    def add(self, tokens: list[int]) -> None:
        if self.max_responses == 0 or not tokens:
            return
        at = self.buffer.size
        self.starts.append(at)
        self.buffer.extend(list(tokens) + [SEPARATOR])
        for i in range(1, len(tokens)):
            self.positions.setdefault((tokens[i - 1], tokens[i]), []).append(at + i)
        if len(self.starts) - self.first > self.max_responses:
            self.first += 1
            if self.first * 2 > len(self.starts) + 64:
                self._compact()

    def _compact(self) -> None:
        """Drop the evicted responses for good (rebuild buffer and index)."""
        live = self.buffer.view()[self.starts[self.first]:].copy()
        offset = self.starts[self.first]
        self.starts = [s - offset for s in self.starts[self.first:]]
        self.first = 0
        self.buffer = TokenBuffer(max(256, live.size))
        self.buffer.extend(live)
        self.positions = {}
        tokens = live.tolist()
        for i in range(1, len(tokens)):
            if tokens[i - 1] != SEPARATOR and tokens[i] != SEPARATOR:
                self.positions.setdefault((tokens[i - 1], tokens[i]), []).append(i)

    def candidates(self, pattern: list[int]) -> np.ndarray:
        """Held positions of pattern's last token after its second last (evicted ones
        left out)."""
        found = self.positions.get(tuple(pattern[-2:])) if len(pattern) >= 2 else None
        if not found:
            return np.empty(0, dtype=np.int64)
        out = np.asarray(found, dtype=np.int64)
        if self.first:
            out = out[out >= self.starts[self.first]]
        return out
