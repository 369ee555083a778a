"""How many KV blocks a runner's budget holds (a mixin of ModelRunner): bytes on CPU,
on GPU what the largest step's profiled peak leaves of gpu_memory_utilization. It reads
the runner's config, shape, device and KV dtype, asks its attention backend a block's
bytes and the most blocks its kernels address, and runs its forward pass."""
from __future__ import annotations

import logging

import torch

from engine.config import CPU_DEFAULT_KV_CACHE_BYTES
from engine.errors import InvalidRequestError
from engine.executor.step_inputs import StepInput, token_slots

logger = logging.getLogger("engine.executor.model_runner")

# GPU memory kept beside the profiled peak for what comes after the profile: the decode
# CUDA graphs' pool (activations of up to 256 single-token rows) and allocator slack.
_GPU_GRAPH_RESERVE_BYTES = 512 << 20


class KVBudget:
    def bytes_per_block(self) -> int:
        return self.attention.block_bytes(self.kv_groups.slots, self.kv_dtype)

    def max_kv_blocks(self) -> int:
        """KV blocks that fit this rank's budget: bytes on CPU (kv_cache_memory_bytes,
        default 2 GiB), a share of free device memory on GPU."""
        if self.config.num_gpu_blocks_override:
            return self.config.num_gpu_blocks_override
        per_block = self.bytes_per_block()
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget()
            if self.config.kv_cache_memory_bytes:
                budget = min(budget, self.config.kv_cache_memory_bytes)
        else:
            budget = self.config.kv_cache_memory_bytes or CPU_DEFAULT_KV_CACHE_BYTES
        blocks = int(budget // per_block)
        limit = self.attention.max_blocks()  # (FlexAttention's 32-bit offsets on CUDA)
        if limit is not None and blocks > limit:
            logger.info("KV cache: %d blocks fit, %d used (32-bit offsets)", blocks, limit)
            blocks = limit
        if blocks < 1:
            raise InvalidRequestError(
                f"KV cache budget of {int(budget)} bytes holds no block of {per_block} bytes")
        return blocks

    def _gpu_kv_budget(self) -> float:
        """Bytes left for the KV cache under gpu_memory_utilization, as vLLM finds it: run
        the largest step the scheduler can make (its token budget, sampling rows for
        max_num_seqs) and keep what its peak left of total * utilization, less memory
        outside torch's allocator (the CUDA context, other processes) and the graphs'
        reserve."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        peak = self._profile_peak()
        budget = (self.config.gpu_memory_utilization * total - peak - outside_torch
                  - _GPU_GRAPH_RESERVE_BYTES)
        logger.info("GPU memory: %.2f GiB total, step peak %.2f GiB (weights included), "
                    "%.2f GiB outside torch: %.2f GiB for the KV cache at utilization %.2f",
                    total / 2**30, peak / 2**30, outside_torch / 2**30, budget / 2**30,
                    self.config.gpu_memory_utilization)
        return budget

    def _profile_peak(self) -> int:
        """Peak bytes torch holds while running the largest step (the profile's own small
        cache excluded)."""
        bs = self.block_size
        tokens = self.config.step_token_budget(self.device)
        longest = min(tokens, self.max_model_len)
        lengths = [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest
                                                      else [])
        lengths = lengths[:self.config.max_num_seqs]
        step = StepInput([], [], [], [], [], [], [])
        block = 0
        for n in lengths:
            table = list(range(block, block - (-n // bs)))
            block += len(table)
            step.ids.extend([0] * n)
            step.positions.extend(range(n))
            step.slots.extend(token_slots(table, 0, n, bs))
            step.query_lens.append(n)
            step.seq_lens.append(n)
            step.block_tables.append(table)
            if self.shape.mamba is not None:  # a hybrid's sequences each hold a state block
                step.state_slots.append(block)
                block += 1
        total = len(step.ids)
        step.logit_positions = list(range(max(0, total - self.config.max_num_seqs), total))
        self.allocate_kv_cache(block, capture=False)
        cache_bytes = self.kv_caches.numel() * self.kv_caches.element_size()
        try:
            self.run(step)
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - cache_bytes
        finally:
            self.free_kv_cache()
            self.num_blocks = 0
            torch.cuda.empty_cache()
