"""suffix (Arctic Inference's suffix decoding): the longest suffix of the context (up to
suffix_decoding_max_tree_depth tokens) matched in the request's own prompt and output,
and in the responses of recent finished requests; the most frequent continuation is
followed while its estimated probability holds (suffix_decoding_min_token_prob), for at
most max_spec_factor tokens per matched token: a long match earns a long proposal, a
short one a short proposal. Of the two sources the one with the larger expected
acceptance wins."""
from __future__ import annotations

import math

import numpy as np

from engine.spec_decode.proposers.base import Proposer
from engine.spec_decode.token_index import ResponseIndex, follow, longest_match


class SuffixProposer(Proposer):
    def __init__(self, config, context=None) -> None:
        super().__init__(config)
        self.responses = ResponseIndex(config.suffix_decoding_max_cached_requests)

    def propose(self, request, k: int) -> list[int]:
        c = self.config
        depth = c.suffix_decoding_max_tree_depth
        buf = self.context(request)
        n = buf.shape[0]
        if n < 2 or k < 1:
            return []
        pattern = buf[-depth:].tolist()
        best, best_score = [], 0.0
        local = longest_match(buf, np.flatnonzero(buf[:n - 1] == pattern[-1]), pattern, depth)
        shared = longest_match(self.responses.buffer.view(),
                               self.responses.candidates(pattern), pattern, depth)
        for (m, ends), source in ((local, buf), (shared, self.responses.buffer.view())):
            if m == 0:
                continue
            limit = min(k, math.floor(m * c.suffix_decoding_max_spec_factor))
            tokens, score = follow(source, ends, limit, c.suffix_decoding_min_token_prob)
            if score > best_score:
                best, best_score = tokens, score
        return best

    def finish(self, request) -> None:
        """Its response joins the shared index (aborted ones too: what was generated is
        as good a guess as any)."""
        super().finish(request)
        self.responses.add(request.output_token_ids)
