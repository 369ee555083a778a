"""What a step hands the forward pass: its batch (StepInput, the same on every TP rank),
whose outputs are whose (StepRows, StepResult), and the attention metadata each
backend reads, built from the batch by the runner (StepMetadataBuilder): per KV group
(engine/core/kv_groups.py) where a model has several, with a hybrid's Mamba states.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from engine.executor.cuda_graphs import padded_size
from engine.model.layers.attention import AttentionMetadata, PrefillGroup
from engine.model.layers.flex_paged import build_group
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
    """The runner's metadata builders (a mixin: they read its backend, device, block
    size and pool)."""

    def _attention_metadata(self, step: StepInput, tables: list[list[int]] | None = None,
                            slots: list[int] | None = None) -> AttentionMetadata:
        """The step's attention metadata over one KV group's block tables and token slots
        (default: group 0's, step.block_tables and step.slots)."""
        dev = self.device
        tables = step.block_tables if tables is None else tables
        slot_mapping = torch.tensor(step.slots if slots is None else slots, dtype=torch.long,
                                    device=dev)
        num_decodes = step.num_decodes()
        if self.flex is not None:
            return self._flex_metadata(step, slot_mapping, num_decodes, tables)
        if self.triton is not None:
            launches = self.triton.step(step.query_lens, step.seq_lens, tables, num_decodes)
            return AttentionMetadata(slot_mapping=slot_mapping, num_decodes=num_decodes,
                                     block_tables=None, seq_lens=None, triton=self.triton,
                                     triton_step=launches)
        if self.native_attention is not None:  # one kernel call for every row
            starts = [0]
            for n in step.query_lens:
                starts.append(starts[-1] + n)
            return AttentionMetadata(
                slot_mapping=slot_mapping, num_decodes=num_decodes,
                block_tables=self._table_tensor(tables),
                seq_lens=torch.tensor(step.seq_lens, dtype=torch.long, device=dev),
                query_start=torch.tensor(starts, dtype=torch.long, device=dev),
                native_attention=self.native_attention)
        lens = bias = None
        if num_decodes:
            decode_tables = self._table_tensor(tables[:num_decodes])
            lens = torch.tensor(step.seq_lens[:num_decodes], dtype=torch.long, device=dev)
            span = torch.arange(decode_tables.shape[1] * self.block_size, device=dev)
            bias = torch.zeros(num_decodes, decode_tables.shape[1] * self.block_size, device=dev)
            bias.masked_fill_(span.unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))
        else:
            decode_tables = None
        return AttentionMetadata(
            slot_mapping=slot_mapping, slot_blocks=slot_mapping // self.block_size,
            slot_offsets=slot_mapping % self.block_size,
            num_decodes=num_decodes, block_tables=decode_tables, seq_lens=lens,
            decode_bias=bias, prefills=self._prefill_groups(step, num_decodes, tables))

    def _state_metadata(self, step: StepInput, num_decodes: int) -> StateMetadata:
        """Where each sequence's Mamba states are, and which start from zeros."""
        return StateMetadata(
            slots=torch.tensor(step.state_slots, dtype=torch.long, device=self.device),
            query_lens=step.query_lens,
            fresh=[n == c for n, c in zip(step.query_lens, step.seq_lens)],
            num_decodes=num_decodes)

    def _flex_metadata(self, step: StepInput, slot_mapping: torch.Tensor,
                       num_decodes: int, tables: list[list[int]]) -> AttentionMetadata:
        """The decodes in one FlexAttention call, then each prefill chunk in its own on
        CUDA (FlexPagedAttention), all chunks in one on the eager reference."""
        groups = []
        count = len(step.query_lens)
        decode_rows = decode_width = 0
        if self.flex.pad_decodes and num_decodes:  # a few static shapes (FlexPagedAttention)
            decode_rows = padded_size(self.decode_sizes, num_decodes)
            decode_width = self.max_pages
        spans = [(0, num_decodes)]
        if self.device.type == "cuda":
            spans += [(i, i + 1) for i in range(num_decodes, count)]
        else:
            spans.append((num_decodes, count))
        first = 0
        for lo, hi in spans:
            if hi > lo:
                decodes = lo == 0 and num_decodes > 0
                groups.append(build_group(first, step.query_lens[lo:hi], step.seq_lens[lo:hi],
                                          tables[lo:hi], self.num_blocks,
                                          self.block_size, self.device,
                                          decode_width if decodes else None,
                                          page_map=not self.flex.compiled,
                                          pad_rows=decode_rows if decodes else 0))
                first += groups[-1].num_tokens
        return AttentionMetadata(slot_mapping=slot_mapping, num_decodes=num_decodes,
                                 block_tables=None, seq_lens=None, flex=self.flex,
                                 flex_groups=groups, slot_pos=self.slot_pos)

    def _table_tensor(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables padded with block 0 to the longest (the kernels stop at seq_lens)."""
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def _prefill_groups(self, step: StepInput, num_decodes: int,
                        tables: list[list[int]]) -> list[PrefillGroup]:
        """Prefill chunks for the torch path: consecutive fresh chunks (no cached context)
        of equal length share one group; a chunk with context carries its block table."""
        groups: list[PrefillGroup] = []
        first = num_decodes
        for i in range(num_decodes, len(step.query_lens)):
            n, ctx = step.query_lens[i], step.seq_lens[i]
            if ctx > n:
                table = torch.tensor(tables[i], dtype=torch.long, device=self.device)
                groups.append(PrefillGroup(first, n, 1, ctx, table))
            elif groups and groups[-1].block_table is None and groups[-1].query_len == n:
                groups[-1].count += 1
            else:
                groups.append(PrefillGroup(first, n, 1, n, None))
            first += n
        return groups


__all__ = ["StepInput", "StepMetadataBuilder", "StepResult", "StepRows", "token_slots"]
