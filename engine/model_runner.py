"""ModelRunner: owns the model weights and the KV cache tensor of one worker.

Turns a SchedulerOutput into flat input tensors (token ids, positions, cache
slots, attention metadata), runs the forward pass, and computes logits only
for the requests that sample this step.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineConfig
from engine.layers.attention import AttentionMetadata, PrefillGroup
from engine.layers.linear import Linear, can_pack, pack_linears
from engine.layers.rotary import RotaryEmbedding
from engine.kernels import cpu_kernels, native_enabled
from engine.model_loader import iter_weights
from engine.models.llama import LlamaForCausalLM, ModelShape
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, shape: ModelShape, hf_config, checkpoint,
                 max_model_len: int, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.shape = shape
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.checkpoint = checkpoint
        self.hf_config = hf_config
        self.max_model_len = max_model_len
        self.kernels = cpu_kernels() if device.type == "cpu" else None
        self.native_decode = None
        if self.kernels is not None and shape.head_dim % 16 == 0:
            self.native_decode = self.kernels.paged_decode_attention
        self.model = self._load_model()
        self.kv_caches: torch.Tensor | None = None
        self.num_blocks = 0

    def _load_model(self) -> LlamaForCausalLM:
        start = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(self.shape, self.hf_config, self.max_model_len, self.kernels)
        model = model.to_empty(device=self.device)
        # Buffers (the RoPE table) are not in the checkpoint: rebuild them for real.
        model.rotary = RotaryEmbedding(self.hf_config, self.shape.head_dim,
                                       self.max_model_len).to(self.device)
        if self.shape.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.load_weights(iter_weights(self.checkpoint))
        model = model.to(self.dtype).eval()
        model.requires_grad_(False)
        if native_enabled() and can_pack(self.device, self.dtype):
            pack_linears(model, keep_dense={id(model.embed_tokens.weight)})
        logger.info("loaded %s in %.2fs", self.shape.architecture, time.perf_counter() - start)
        return model

    # ---- KV cache ---------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        s = self.shape
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.shape
        self.num_blocks = num_blocks
        # zeros, not empty: masked-out slots still enter the matmuls, and 0 * NaN = NaN
        self.kv_caches = torch.zeros(s.num_layers, 2, s.num_kv_heads, num_blocks,
                                     self.block_size, s.head_dim, dtype=self.dtype,
                                     device=self.device)

    def free_kv_cache(self) -> None:
        self.kv_caches = None

    # ---- sleep mode -------------------------------------------------------------------
    def has_weights(self) -> bool:
        return self.model is not None and next(self.model.parameters()).device == self.device

    def offload_weights(self) -> None:
        """Move the weights to host memory (sleep level 1 on an accelerator)."""
        self.model.to("cpu")

    def free_weights(self) -> None:
        """Drop the weights (sleep level 2); restore_weights reloads the checkpoint."""
        self.model = None

    def restore_weights(self) -> None:
        if self.model is None:
            self.model = self._load_model()
        elif not self.has_weights():
            self.model.to(self.device)

    def memory_usage(self) -> dict[str, int]:
        weights = 0
        if self.model is not None:
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters()
                          if p.device == self.device)
            weights += sum(m.packed_bytes() for m in self.model.modules()
                           if isinstance(m, Linear))
        kv = 0 if self.kv_caches is None else self.kv_caches.numel() * self.kv_caches.element_size()
        return {"weights_bytes": weights, "kv_cache_bytes": kv}

    # ---- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[int]]:
        """Run the forward pass; return logits [S, V] and the batch rows that sample."""
        bs = self.block_size
        order = sorted(range(len(sched.requests)), key=lambda i: sched.num_new_tokens[i] != 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillGroup] = []
        sample_rows: list[int] = []  # index into sched.requests
        logit_positions: list[int] = []  # token index in the flat batch
        for i in order:
            request, n = sched.requests[i], sched.num_new_tokens[i]
            start = request.num_computed_tokens
            end = start + n
            first = len(ids)
            ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            blocks = request.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            num_ctx_blocks = -(-end // bs)
            if n == 1:
                decode_tables.append(blocks[:num_ctx_blocks])
                decode_lens.append(end)
            elif start > 0:
                prefills.append(PrefillGroup(first, n, 1, end, torch.tensor(
                    blocks[:num_ctx_blocks], dtype=torch.long, device=self.device)))
            elif (prefills and prefills[-1].block_table is None
                  and prefills[-1].query_len == n):
                prefills[-1].count += 1  # batch equal-length fresh prefills in one call
            else:
                prefills.append(PrefillGroup(first, n, 1, n, None))
            if end == request.num_tokens:
                sample_rows.append(i)
                logit_positions.append(len(ids) - 1)

        meta = self._attention_metadata(slots, decode_tables, decode_lens, prefills)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos, self.kv_caches, meta)
        if not sample_rows:
            return hidden.new_empty((0, self.shape.vocab_size), dtype=torch.float32), []
        index = torch.tensor(logit_positions, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return logits, sample_rows

    def _attention_metadata(self, slots: list[int], decode_tables: list[list[int]],
                            decode_lens: list[int], prefills: list[PrefillGroup]
                            ) -> AttentionMetadata:
        tables = bias = lens = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            tables = torch.tensor(padded, dtype=torch.long, device=self.device)
            lens = torch.tensor(decode_lens, dtype=torch.long, device=self.device)
            span = torch.arange(width * self.block_size, device=self.device)
            if self.native_decode is None:
                bias = torch.zeros(len(decode_lens), width * self.block_size,
                                   device=self.device)
                bias.masked_fill_(span.unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            slot_blocks=slot_mapping // self.block_size,
            slot_offsets=slot_mapping % self.block_size,
            num_decodes=len(decode_tables), decode_block_tables=tables, decode_seq_lens=lens,
            decode_bias=bias, prefills=prefills, native_decode=self.native_decode)
