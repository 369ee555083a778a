"""draft_model: a smaller checkpoint with the target's vocabulary, run by this engine
beside the target (its own weights and KV cache, one rank), proposes greedily.

The draft's cache has the target's block ids: a request's block table indexes both, so
the draft needs no allocator of its own. Each step the draft first computes its keys and
values for the request's tokens it has not seen (all of them after a preemption or for
a new request; usually the last one or the accepted ones), which also gives the logits
of the first proposed token; then one pass per further token. Proposed tokens past the
request's blocks are written to scratch blocks after the pool (a few per sequence of
the batch): they are recomputed once accepted, so nothing outside the request's own
blocks is ever read as context.
"""
from __future__ import annotations

import dataclasses

import torch

from engine.errors import InvalidRequestError
from engine.spec_decode.proposers.base import ModelProposer


class DraftModelProposer(ModelProposer):
    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        from engine.executor.model_runner import ModelRunner
        from engine.model.loader import load_hf_config, resolve_model
        from engine.model.shape import ModelShape
        c = context.engine_config
        checkpoint = resolve_model(config.model, weights=c.load_format != "dummy")
        hf_config = load_hf_config(checkpoint)
        shape = ModelShape.from_hf_config(hf_config)
        _check(shape, context.target_shape, context.max_model_len, config.model)
        draft_config = dataclasses.replace(
            c, model=str(checkpoint), tensor_parallel_size=1, enable_lora=False,
            lora_modules=None, allowed_lora_roots=None, speculative_config=None,
            quantization=None, num_gpu_blocks_override=None)
        self.runner = ModelRunner(draft_config, shape, hf_config, checkpoint,
                                  context.max_model_len, context.device, context.dtype)
        self.vocab_size = shape.vocab_size

    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block()

    def start(self, num_blocks: int) -> None:
        """The draft's cache: the pool's blocks, then the scratch blocks."""
        self.num_blocks = num_blocks
        self.runner.allocate_kv_cache(num_blocks + self.max_seqs * self.spare)

    def sleep(self, level: int) -> None:
        self.runner.free_kv_cache()
        if level == 2:
            self.runner.free_weights()
        elif self.runner.device.type != "cpu":
            self.runner.offload_weights()

    def wake(self) -> None:
        self.runner.restore_weights()
        if self.runner.kv_caches is None:
            self.start(self.num_blocks)

    @torch.inference_mode()
    def propose_batch(self, requests, rooms: list[int]) -> list[list[int]]:
        from engine.executor.step_inputs import StepInput, token_slots
        bs = self.block_size
        rows = []  # (request, room, first unseen token, tokens, block table)
        for slot, (r, k) in enumerate((r, k) for r, k in zip(requests, rooms) if k > 0):
            n = r.num_tokens
            rows.append((r, k, min(self.written(r), n - 1), n, self.table(r, slot)))
            self.mark_written(r, min(n, len(r.block_ids) * bs))
        rows.sort(key=lambda row: row[3] - row[2] != 1)  # one-token queries first
        drafts: dict[int, list[int]] = {}
        for j in range(max((row[1] for row in rows), default=0)):
            step = StepInput([], [], [], [], [], [], [])
            live = [row for row in rows if row[1] > j]
            for r, _, done, n, table in live:
                if j == 0:  # catch up on the request's tokens; the last gives a logit
                    ids, first = r.all_token_ids[done:n], done
                else:
                    ids, first = [drafts[id(r)][-1]], n - 1 + j
                end = first + len(ids)
                step.ids.extend(ids)
                step.positions.extend(range(first, end))
                step.slots.extend(token_slots(table, first, end, bs))
                step.query_lens.append(len(ids))
                step.seq_lens.append(end)
                step.block_tables.append(table[:-(-end // bs)])
                step.logit_positions.append(len(step.ids) - 1)
            logits = self.runner.run(step)[0][:, :self.vocab_size]
            for (r, *_), token in zip(live, logits.argmax(dim=-1).tolist()):
                drafts.setdefault(id(r), []).append(token)
        return [drafts.get(id(r), []) for r in requests]


def _check(shape, target, max_model_len: int, name: str) -> None:
    """Refuse a draft this engine cannot pair with the target, by name."""
    problems = []
    if shape.vocab_size != target.vocab_size:
        problems.append(f"its vocabulary ({shape.vocab_size}) is not the target's "
                        f"({target.vocab_size})")
    if shape.mamba is not None or any(shape.layer_windows):
        problems.append("it has Mamba or sliding-window layers (a draft must be a plain "
                        "full-attention model)")
    if any(target.layer_windows) or target.mamba is not None:
        problems.append("the target has sliding-window or Mamba layers, whose block tables "
                        "the draft cannot share")
    if shape.max_position_embeddings < max_model_len:
        problems.append(f"it supports {shape.max_position_embeddings} positions, fewer than "
                        f"the target's max_model_len {max_model_len}")
    if problems:
        raise InvalidRequestError(f"speculative_config draft model {name!r}: "
                                  + "; ".join(problems))
