"""SpecDecoder: the engine core's side of speculative decoding.

Before a step it asks the proposer for each decoding request's next tokens (bounded by
num_speculative_tokens, the request's max_tokens and the context length); the
scheduler then schedules them with the request's last token, and the runner returns a
logits row for each (engine/spec_decode/verify.py). After sampling, settle() keeps
the accepted prefix: the request's computed tokens go back to what the accepted tokens
cover, and the KV slots of the rejected ones are handed back (the prefix cache never
registered them: it hashes only a request's known tokens).
"""
from __future__ import annotations

from engine.core.request import Request
from engine.errors import InvalidRequestError
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposers import ProposerContext, make_proposer
from engine.spec_decode.stats import SpecStats
from engine.spec_decode.verify import accepted_count


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        self.config = config
        self.max_model_len = context.max_model_len  # lowered by start() to the pool's
        self.proposer = make_proposer(config, context)
        self.stats = SpecStats(config.num_speculative_tokens)
        # backoff_after_misses: per request, proposals in a row with nothing accepted,
        # and steps left before it is asked again
        self._misses: dict[str, int] = {}
        self._resting: dict[str, int] = {}

    def start(self, num_blocks: int, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.proposer.start(num_blocks)

    @staticmethod
    def check_model(shape) -> None:
        """Refuse what verification cannot undo: a recurrent state (Mamba layers) would
        have advanced over the rejected tokens."""
        if shape.mamba is not None:
            raise InvalidRequestError(
                f"speculative decoding is not served for {shape.architecture}: its Mamba "
                "states cannot be rolled back past rejected tokens")

    def propose(self, running: list[Request]) -> None:
        """Each decoding request's proposal for this step (others get none)."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(running) > limit
        asked, rooms = [], []
        for r in running:
            r.spec_tokens = []
            if off or not self._speculates(r):
                continue
            rest = self._resting.get(r.request_id, 0)
            if rest:
                self._resting[r.request_id] = rest - 1
                continue
            room = min(self.config.num_speculative_tokens, self.max_model_len - r.num_tokens)
            if r.params.max_tokens is not None:
                room = min(room, r.params.max_tokens - r.num_output_tokens - 1)
            if room > 0:
                asked.append(r)
                rooms.append(room)
        if asked:
            for r, room, tokens in zip(asked, rooms, self.proposer.propose_batch(asked, rooms)):
                r.spec_tokens = tokens[:room]

    @staticmethod
    def _speculates(r: Request) -> bool:
        return (r.num_computed_tokens == r.num_tokens - 1 and r.pooling is None
                and r.params.speculative_decoding and r.num_output_tokens > 0)

    def settle(self, request: Request, sampled: list[int]) -> int:
        """The request's proposal against its sampled rows: returns how many proposed
        tokens were accepted, with the computed-token count set back past the rejected
        ones and the counters updated."""
        drafts = request.spec_tokens
        if not drafts:
            return 0
        accepted = accepted_count(sampled, drafts)
        request.num_computed_tokens -= len(drafts) - accepted
        request.spec_tokens = []
        self.stats.record(len(drafts), accepted)
        self._back_off(request.request_id, accepted)
        return accepted

    def _back_off(self, request_id: str, accepted: int) -> None:
        """Rest a request whose proposals keep missing (backoff_after_misses)."""
        after = self.config.backoff_after_misses
        if accepted or not after:
            self._misses.pop(request_id, None)
            return
        misses = self._misses[request_id] = self._misses.get(request_id, 0) + 1
        if misses >= after:
            self._resting[request_id] = min(2 ** (misses - after), 8)

    def finish(self, request: Request) -> None:
        request.spec_tokens = []
        self._misses.pop(request.request_id, None)
        self._resting.pop(request.request_id, None)
        self.proposer.finish(request)
