"""Acceptance counters of speculative decoding (vLLM's vllm:spec_decode_* metrics)."""
from __future__ import annotations


class SpecStats:
    """Counts from the engine's start: steps with a proposal (drafts), proposed tokens,
    accepted tokens, and accepted tokens by position in the proposal."""

    def __init__(self, max_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * max_tokens

    def as_fields(self) -> dict:
        """SchedulerStats' spec_* fields."""
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_pos": list(self.accepted_per_pos)}

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
