"""What a step hands the forward pass: its batch (StepInput, the same on every TP rank),
whose outputs are whose (StepRows, StepResult), and the attention metadata, which the
runner's attention backend builds from the batch (StepMetadataBuilder asks it): per KV
group (engine/core/kv_groups.py) where a model has several, with a hybrid's Mamba
states.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from engine.model.attention.base import AttentionMetadata
from engine.model.layers.mamba import StateMetadata


def token_slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slots (block * block_size + offset) of positions [start, end) under a
    block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class StepInput(msgspec.Struct, array_like=True, gc=False):
    """One step's batch for the forward pass, the same on every TP rank.

    Sequences are in batch order, decodes (one new token) first; each owns its last
    query_lens[i] tokens of ids/positions/slots."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]  # new tokens of each sequence this step
    seq_lens: list[int]  # its context after this step, new tokens included
    block_tables: list[list[int]]  # its blocks covering seq_lens
    logit_positions: list[int]  # flat token index of each sampling row
    pool_spans: list[list[int]] = []  # [start, end) flat tokens of each embedding request
    # [start, end, top) flat tokens whose logits give prompt logprobs, with top-k each
    prompt_spans: list[list[int]] = []
    prompt_targets: list[int] = []  # the prompt token each of those positions scores
    lora_segments: list[list[int]] = []  # [start, end, slot) runs of one adapter's tokens
    state_slots: list[int] = []  # a hybrid's: each sequence's state block (batch order)
    # models with several KV groups (engine.core.kv_groups): the block tables and token
    # slots of groups 1.. (block_tables and slots above are group 0's)
    group_tables: list[list[list[int]]] = []
    group_slots: list[list[int]] = []
    # every sequence computes only generated tokens: its last one, and any proposed ones
    generated_only: bool = False

    def num_decodes(self) -> int:
        """The leading sequences with one new token each (decodes come first)."""
        return next((i for i, n in enumerate(self.query_lens) if n != 1), len(self.query_lens))


@dataclass
class StepRows:
    """What each output of a step belongs to (indexes into the step's requests)."""

    sample: list[int] = field(default_factory=list)  # one per sampling logits row
    pool: list[int] = field(default_factory=list)  # one per pool span
    prompt: list[tuple[int, int]] = field(default_factory=list)  # (request, first position)


@dataclass
class StepResult:
    logits: torch.Tensor | None  # [S, V] for the sampling rows
    sample_rows: list[int]  # index into the step's requests, one per logits row
    pooled: list[tuple[int, torch.Tensor]]  # (request index, hidden states [n, H]) per span
    # (request index, (ids, logprobs, ranks) of each prompt position of its span)
    prompt_logprobs: list[tuple[int, list]] = field(default_factory=list)

    @classmethod
    def build(cls, step: StepInput, rows: StepRows, logits: torch.Tensor | None,
              pooled: list[torch.Tensor], prompt_rows: list | None) -> "StepResult":
        """Split run()'s flat prompt logprobs per span."""
        spans = []
        if prompt_rows is not None:
            at = 0
            for (i, _), (start, end, _) in zip(rows.prompt, step.prompt_spans):
                spans.append((i, prompt_rows[at:at + end - start]))
                at += end - start
        return cls(logits, rows.sample, list(zip(rows.pool, pooled)), spans)


class StepMetadataBuilder:
    """The runner's metadata builders (a mixin: they read its attention backend and
    device)."""

    def _attention_metadata(self, step: StepInput, tables: list[list[int]] | None = None,
                            slots: list[int] | None = None) -> AttentionMetadata:
        """The step's attention metadata over one KV group's block tables and token slots
        (default: group 0's, step.block_tables and step.slots)."""
        tables = step.block_tables if tables is None else tables
        slot_mapping = torch.tensor(step.slots if slots is None else slots, dtype=torch.long,
                                    device=self.device)
        return self.attention.build_metadata(step.query_lens, step.seq_lens, tables,
                                             slot_mapping, step.num_decodes())

    def _state_metadata(self, step: StepInput, num_decodes: int) -> StateMetadata:
        """Where each sequence's Mamba states are, and which start from zeros."""
        return StateMetadata(
            slots=torch.tensor(step.state_slots, dtype=torch.long, device=self.device),
            query_lens=step.query_lens,
            fresh=[n == c for n, c in zip(step.query_lens, step.seq_lens)],
            num_decodes=num_decodes)


__all__ = ["StepInput", "StepMetadataBuilder", "StepResult", "StepRows", "token_slots"]
