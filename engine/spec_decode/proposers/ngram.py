"""ngram (prompt lookup): the longest suffix of the context, prompt_lookup_max tokens at
most and prompt_lookup_min at least, found earlier in the prompt or output; the tokens
that followed its latest occurrence are the proposal."""
from __future__ import annotations

import numpy as np

from engine.spec_decode.proposers.base import Proposer
from engine.spec_decode.token_index import longest_match


class NgramProposer(Proposer):
    def propose(self, request, k: int) -> list[int]:
        buf = self.context(request)
        n = buf.shape[0]
        if n < 2 or k < 1:
            return []
        c = self.config
        pattern = buf[-c.prompt_lookup_max:].tolist()
        candidates = np.flatnonzero(buf[:n - 1] == pattern[-1])
        m, ends = longest_match(buf, candidates, pattern, c.prompt_lookup_max)
        if m < c.prompt_lookup_min:
            return []
        start = int(ends[-1]) + 1  # the latest occurrence
        return buf[start:start + k].tolist()
