"""The decoder every family builds on: attention, gated MLP, layer, and the model.

Each family's network (engine/model/families/<name>.py) is this decoder with changes,
through hooks rather than copies: `layer_class` (a layer of another layout), `make_mlp`
(a layer's MLP, e.g. experts), `make_rotary` / `layer_ropes` (per-layer RoPE), and for
its checkpoint `checkpoint_name`, `load_family_tensor` and `expected_loads`, which the
shared loader (engine.model.families.loading) calls. q/k/v and gate/up projections are
fused into one matmul each; the loader slices the checkpoint's separate tensors into
them. Which flags a family sets (biases, q/k norm, windows, sinks, scale) come from its
ModelShape.

Under tensor parallelism (engine.executor.parallel) every layer holds one rank's shard:
q/k/v and gate/up are split by output (column-parallel, still fused per rank),
o_proj and down_proj by input (row-parallel, summed with an all-reduce; a bias is
held by rank 0 only so the sum adds it once), the embedding and LM head by
vocabulary rows. The loader reads only this rank's slice of each tensor.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.executor.parallel import ShardPlan, TPGroup
from engine.model.attention.base import AttentionMetadata
from engine.model.families.loading import expected_keys, load_checkpoint
from engine.model.layers.embedding import VocabEmbedding
from engine.model.layers.linear import Linear
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import Rope, RotaryEmbedding, apply_rotary
from engine.model.shape import ModelShape
from engine.quant.gguf_linear import DECODE_DENSE_ROWS, DENSE_ROWS


class Attention(nn.Module):
    lora = None  # LoRASlots once LoRA is enabled (attach_lora), with layer_index
    layer_index = 0
    # an fp8 KV cache's scales: the checkpoint's self_attn.k_scale / v_scale (read into
    # checkpoint_kv_scales, set by the runner when the cache is fp8), else 1.0
    k_scale = 1.0
    v_scale = 1.0
    checkpoint_kv_scales: dict = {}

    def __init__(self, shape: ModelShape, plan: ShardPlan, tp: TPGroup | None,
                 kernels=None, window: int = 0) -> None:
        """window: the layer's sliding window (0: it sees the whole context)."""
        super().__init__()
        self.kernels = kernels
        self.tp = tp
        self.window = window
        self.num_heads, self.num_kv_heads, self.head_dim = (
            plan.num_heads, plan.num_kv_heads, shape.head_dim)
        self.q_size = plan.num_heads * shape.head_dim
        self.kv_size = plan.num_kv_heads * shape.head_dim
        self.qkv_proj = Linear(shape.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=shape.qkv_bias)
        self.o_proj = Linear(self.q_size, shape.hidden_size,
                             bias=shape.o_bias and plan.rank == 0)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.scale = shape.attention_scale or shape.head_dim ** -0.5
        # gpt-oss: this rank's heads' sinks, a logit each joining every softmax
        self.sinks = nn.Parameter(torch.empty(plan.num_heads), requires_grad=False) \
            if shape.attention_sinks else None

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """The step's attention backend (the one that built meta, engine.model.attention)
        takes the fused qkv rows: it has them rotated here (rotated) or rotates them in
        its own kernels (normed_qkv first)."""
        qkv = self.qkv_proj(x)
        if self.lora is not None:
            self.lora.add(self.layer_index, "qkv_proj", x, qkv)
        return self._project(meta.backend.forward(self, qkv, rope, kv_cache, meta))

    def rotated(self, qkv: torch.Tensor,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D] of the fused qkv rows, q/k-normed and rotated:
        by the native rotary in place inside the rows where the layer has the CPU
        kernels, else by torch ops."""
        t = qkv.shape[0]
        native_rope = self.kernels is not None
        if native_rope:  # rotate q and k heads in place inside the fused qkv rows
            qkv = self.normed_qkv(qkv)
            self.kernels.rotary_inplace(qkv, rope.positions, rope.cos_table, rope.sin_table,
                                        self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not native_rope:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, k, rope.cos, rope.sin)
        return q, k, v

    def normed_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """q/k norm (Qwen3's, Gemma 3's): q and k heads normalised before the rotary, as a
        new fused qkv (which the Triton kernels and the native rotary then take as any
        model's); qkv itself where the layer has no q/k norm."""
        if self.q_norm is None:
            return qkv
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, -1)
        return torch.cat([q, k, v], dim=-1)

    def _project(self, o: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [T, H * D], LoRA and the TP all-reduce."""
        out = self.o_proj(o)
        if self.lora is not None:
            self.lora.add(self.layer_index, "o_proj", o, out)
        return self.tp.all_reduce(out) if self.tp is not None else out


class GatedMLP(nn.Module):
    lora = None  # as Attention
    layer_index = 0

    def __init__(self, shape: ModelShape, plan: ShardPlan, tp: TPGroup | None,
                 kernels=None) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp = tp
        self.intermediate = plan.intermediate_size
        self.gate_up_proj = Linear(shape.hidden_size, 2 * plan.intermediate_size,
                                   bias=shape.mlp_bias)
        self.gate_up_proj.glu_halves = True
        self.down_proj = Linear(plan.intermediate_size, shape.hidden_size,
                                bias=shape.mlp_bias and plan.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self._activation(x)
        out = self.down_proj(act)
        if self.lora is not None:
            self.lora.add(self.layer_index, "down_proj", act, out)
        return self.tp.all_reduce(out) if self.tp is not None else out

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: in the gate_up matmul's own pass where it fuses it (no LoRA,
        which adds to the [gate | up] product first), else from that product."""
        if self.lora is None and self.gate_up_proj.fuses_glu:
            return self.gate_up_proj.forward_glu(x)
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            self.lora.add(self.layer_index, "gate_up_proj", x, gate_up)
        if self.kernels is not None:
            return self.kernels.silu_and_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, plan: ShardPlan, tp: TPGroup | None,
                 kernels=None, mlp: nn.Module | None = None, layer: int = 0) -> None:
        """mlp: the layer's MLP where a family replaces the dense one (experts)."""
        super().__init__()
        eps = shape.rms_norm_eps
        self.input_layernorm = RMSNorm(shape.hidden_size, eps, kernels)
        self.self_attn = Attention(shape, plan, tp, kernels, shape.window(layer))
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps, kernels)
        self.mlp = mlp if mlp is not None else GatedMLP(shape, plan, tp, kernels)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous layer's output and the running residual stream."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderForCausalLM(nn.Module):
    """The decoder stack plus LM head; forward returns hidden states of every token."""

    layer_class = DecoderLayer  # a family with another layer layout sets its own

    def __init__(self, shape: ModelShape, hf_config: PretrainedConfig, max_positions: int,
                 kernels=None, plan: ShardPlan | None = None, tp: TPGroup | None = None
                 ) -> None:
        """kernels: the compiled CPU ops module (engine.model.kernels), or None for torch ops.
        plan / tp: this rank's shard and its group (default: the whole model, no TP)."""
        super().__init__()
        self.shape = shape
        self.plan = plan = plan or ShardPlan.build(shape, 0, 1)
        self.tp = tp if plan.size > 1 else None
        self.make_rotary(hf_config, max_positions)
        # its weight made empty, not drawn at random: built on the meta device, normal_
        # runs through torch's Python references, whose first call imports torch._dynamo
        # (1.7 s of every engine start); the checkpoint fills it
        self.embed_tokens = VocabEmbedding(plan.vocab_per_rank, shape.hidden_size,
                                           _weight=torch.empty(plan.vocab_per_rank,
                                                               shape.hidden_size))
        self.layers = nn.ModuleList(
            self.layer_class(shape, plan, self.tp, kernels, self.make_mlp(i, kernels), i)
            for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, kernels)
        self.lm_head = Linear(shape.hidden_size, plan.vocab_per_rank, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, hf_config: PretrainedConfig, max_positions: int,
                    device: torch.device | None = None) -> None:
        """The RoPE tables: buffers the checkpoint lacks, so the runner builds them again
        on the real device once the model leaves the meta one."""
        self.rotary = RotaryEmbedding(hf_config, self.shape.head_dim, max_positions).to(device)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """Each layer's rotary of a step's positions (one for all layers here)."""
        return [self.rotary.lookup(positions, dtype)] * len(self.layers)

    def make_mlp(self, layer: int, kernels) -> nn.Module | None:
        """A layer's MLP where the family's differs from the dense one (None: dense)."""
        return None

    # engine.model.stack's DecoderStack where the runner built one: the layers as one
    # native call for the steps it can run (native attention, no LoRA)
    stack = None
    stack_layout = True  # whether the layers are the stack's (a family with others: False)
    layer_groups: list[int] = []  # each layer's KV group, where the runner set several
    _stack_caches: tuple = (None, None, None)
    _prompt_step = False  # whether the last forward held prompt tokens
    # layers whose incoming residual streams a forward keeps (an EAGLE-3 head reads them;
    # len(layers): the last layer's output), concatenated in this order into aux_hidden
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    def attach_lora(self, slots) -> None:
        """Have every attention and MLP block add the step's adapter products
        (engine.lora.slots.LoRASlots) after its projections."""
        self.stack = None  # the stack has no adapters
        for i, layer in enumerate(self.layers):
            for block in (layer.self_attn, layer.mlp):
                block.lora, block.layer_index = slots, i

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.lookup(ids, self.norm.weight.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(input_ids)
        local = input_ids - self.plan.vocab_start
        outside = (local < 0) | (local >= self.plan.vocab_per_rank)
        x = self._lookup(local.masked_fill(outside, 0))
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                ) -> torch.Tensor:
        """kv_caches: each layer's (keys, values) views of the paged cache
        (the attention backend's cache_views), this rank's kv heads."""
        x = self.embed(input_ids)
        self._prompt_step = meta.num_decodes != x.shape[0] and not meta.generated_only
        # the stack reads the native backend's metadata (AttentionBackend.runs_stack)
        if self.stack is not None and meta.backend.runs_stack and not self.aux_layers:
            keys, values = self._cache_lists(kv_caches)
            dense_rows = DENSE_ROWS if self._prompt_step else DECODE_DENSE_ROWS
            return self.stack.forward(x, positions, self.rotary.cos, self.rotary.sin, keys,
                                      values, meta.slot_mapping, meta.block_tables,
                                      meta.seq_lens, meta.query_start, dense_rows)
        residual = None
        kept: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache, rope) in enumerate(zip(self.layers, kv_caches,
                                                        self.layer_ropes(positions, x.dtype))):
            if i in self.aux_layers:  # copies: the layers add into their inputs in place
                kept[i] = x.clone() if residual is None else x + residual
            layer_meta = meta.groups[self.layer_groups[i]] if meta.groups else meta
            x, residual = layer(rope, x, residual, kv_cache, layer_meta)
        if self.aux_layers:
            if len(self.layers) in self.aux_layers:
                kept[len(self.layers)] = x + residual
            self.aux_hidden = torch.cat([kept[i] for i in self.aux_layers], dim=-1)
        return self.norm(x, residual)[0]

    def _cache_lists(self, kv_caches) -> tuple[list, list]:
        """The layers' key and value views as two lists, kept while the caches are."""
        held, keys, values = self._stack_caches
        if held is not kv_caches:
            keys, values = [k for k, _ in kv_caches], [v for _, v in kv_caches]
            self._stack_caches = (kv_caches, keys, values)
        return keys, values

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits over the whole vocabulary; under TP they are gathered on rank 0
        (the sampler's rank) and the other ranks get None."""
        if self.tp is None:
            # GGUF: a prompt step's logits (each request's first token) from the decoded
            # weight, a decode step's from the int8 products (the default model answered
            # "What is the capital of France?" with "L'Étoile" when both were int8)
            return self.lm_head.forward_float(
                hidden, dense_rows=0 if self._prompt_step else DECODE_DENSE_ROWS)
        logits = self.tp.gather_last_dim(self.lm_head(hidden))
        if logits is None:
            return None
        return logits[:, :self.shape.vocab_size].float()

    def load_weights(self, weights: Iterable[tuple[str, Any]], holder: Any = None,
                     fp8_block: tuple[int, int] | None = None) -> int:
        """Copy this rank's slice of each checkpoint tensor (HF names) into the fused
        parameters. weights yields (name, t) where t is a tensor, a lazy safetensors
        slice or GGUF blocks (engine.quant.gguf_weights); only the sliced rows/columns
        are read. holder: the WeightHolder (engine.quant.held) whose kernels multiply
        quantized weights (GGUF blocks, int8 W8A8, fp8) as they are; the linears and the
        embedding then keep what it holds (their dense weights are released), and what
        it declines, or all of them without one, is decoded to floats. fp8_block: (rows, columns) of a block-wise fp8 checkpoint's scale blocks.

        Returns how many of the parameters came quantized (int8 or e4m3 weights; GGUF
        blocks where a kernel holds them). Raises UnsupportedModelError naming any
        parameter the checkpoint left unset.
        """
        return load_checkpoint(self, weights, holder, fp8_block)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name (without "model.") in this module's terms."""
        return name

    def load_family_tensor(self, name: str, tensor, loaded: set[str]) -> bool:
        """Load a tensor the family lays out its own way, noting it in loaded; False for
        the ones the shared rules load."""
        return False

    def expected_loads(self, params: dict, rules: dict) -> set[str]:
        """The keys load_weights must have noted once every tensor is in."""
        return expected_keys(params, rules)


__all__ = ["Attention", "DecoderForCausalLM", "DecoderLayer", "GatedMLP"]
