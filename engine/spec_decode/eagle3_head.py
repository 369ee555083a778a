"""An EAGLE-3 draft head, as published checkpoints ship it (LlamaForCausalLMEagle3).

One decoder layer that reads the target's hidden states: `fc` folds the residual streams
entering three of the target's layers (low, middle, high: the config's
eagle_aux_hidden_state_layer_ids, else 2, L/2 and L-3) into one hidden vector; the
layer's attention takes [norm(embedding of the next token), norm(that vector)] (twice
the hidden size) and its own KV cache; the output before the final norm is fed back as
the next position's vector, the normed one goes through an LM head over the draft's own
vocabulary, mapped to the target's ids by `d2t` (target id = draft id + d2t[draft id]).
The embedding is the target's unless the checkpoint has its own.

Attention here is plain torch over the head's paged cache (the target's block ids and
token slots), one sequence at a time: the head is one layer, small beside the target.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import InvalidRequestError
from engine.model.layers.rotary import RotaryEmbedding, apply_rotary


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def aux_layer_ids(hf_config, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose incoming residual streams the head reads (L: the last
    layer's output)."""
    eagle = getattr(hf_config, "eagle_config", None) or {}
    ids = (eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None) \
        or getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or not all(0 <= i <= num_target_layers for i in ids):
        raise InvalidRequestError(
            f"EAGLE-3 head: aux hidden state layers {list(ids)} do not fit a target of "
            f"{num_target_layers} layers (three ids in [0, {num_target_layers}])")
    return ids


class Eagle3Head(nn.Module):
    def __init__(self, hf_config, target_hidden: int, max_positions: int) -> None:
        super().__init__()
        c = hf_config
        h = c.hidden_size
        self.hidden_size = h
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = getattr(c, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(c, "head_dim", None) or h // self.num_heads
        bias = bool(getattr(c, "attention_bias", False))
        eps = getattr(c, "rms_norm_eps", 1e-6)
        self.draft_vocab = getattr(c, "draft_vocab_size", None) or c.vocab_size
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.input_layernorm = _RMSNorm(h, eps)
        self.hidden_norm = _RMSNorm(h, eps)
        self.q_proj = nn.Linear(2 * h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.post_attention_layernorm = _RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = _RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, self.draft_vocab, bias=False)
        self.embed_tokens: nn.Embedding | None = None  # the checkpoint's own, if any
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
        self.rotary = RotaryEmbedding(c, self.head_dim, max_positions)

    # checkpoint name -> this module's (the layer's weights under midlayer. or layers.0.)
    _RENAMES = {"mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
                "mlp.down_proj": "down_proj", "self_attn.q_proj": "q_proj",
                "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
                "self_attn.o_proj": "o_proj"}

    def load(self, weights, target_vocab: int) -> None:
        """(name, tensor-like) pairs of an EAGLE-3 checkpoint; every tensor of the head
        must be found (t2d, the target-to-draft mask, is not needed; d2t may be missing
        only where the draft vocabulary is the target's)."""
        own = dict(self.named_parameters())
        own["d2t"] = self.d2t
        seen = set()
        for name, value in weights:
            key = name.removeprefix("model.")
            for prefix in ("midlayer.", "layers.0."):
                if key.startswith(prefix):
                    key = key[len(prefix):]
            for old, new in self._RENAMES.items():
                if key.startswith(old + "."):
                    key = new + key[len(old):]
            if key == "t2d":
                continue
            tensor = value[:] if not isinstance(value, torch.Tensor) else value
            if key == "embed_tokens.weight":
                self.embed_tokens = nn.Embedding.from_pretrained(tensor.float(), freeze=True)
                seen.add(key)
                continue
            if key not in own:
                raise InvalidRequestError(f"EAGLE-3 head: unexpected tensor {name!r}")
            if tuple(own[key].shape) != tuple(tensor.shape):
                raise InvalidRequestError(
                    f"EAGLE-3 head: {name!r} is {tuple(tensor.shape)}, expected "
                    f"{tuple(own[key].shape)}")
            with torch.no_grad():
                own[key].copy_(tensor.to(own[key].dtype))
            seen.add(key)
        missing = sorted(k for k in own if k not in seen)
        if "d2t" in missing and self.draft_vocab == target_vocab:
            missing.remove("d2t")  # no mapping: the draft vocabulary is the target's
        if missing:
            raise InvalidRequestError(f"EAGLE-3 head: the checkpoint lacks {missing}")

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                cache: torch.Tensor, slots: torch.Tensor, spans) -> torch.Tensor:
        """hidden: [T, 3 x target hidden] (the target's streams) or [T, hidden] (fed back);
        embeds: [T, hidden] of the next tokens; spans: (query rows, context length, block
        table tensor) per sequence, in row order. Returns the pre-norm outputs [T, hidden]."""
        if hidden.shape[-1] != self.hidden_size:
            hidden = self.fc(hidden)
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        rope = self.rotary.lookup(positions, q.dtype)
        q, k = apply_rotary(q, k, rope.cos, rope.sin)
        attn = self._attend(q, k, v, cache, slots, spans)
        h = self.o_proj(attn) + residual
        x = self.post_attention_layernorm(h)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + h

    def logits_to_target(self, prenorm: torch.Tensor) -> torch.Tensor:
        """The target's id of the head's greedy token for each row."""
        draft_ids = self.lm_head(self.norm(prenorm)).argmax(dim=-1)
        return draft_ids + self.d2t[draft_ids]

    def _attend(self, q, k, v, cache, slots, spans) -> torch.Tensor:
        """Write k, v at the slots of the head's cache [blocks, 2, kv heads, block, dim],
        then each sequence's queries attend causally over its context."""
        bs = cache.shape[3]
        cache[slots // bs, 0, :, slots % bs] = k.to(cache.dtype)
        cache[slots // bs, 1, :, slots % bs] = v.to(cache.dtype)
        groups = self.num_heads // self.num_kv_heads
        out, at = [], 0
        for rows, length, table in spans:
            blocks = cache[table]  # [n, 2, kv, bs, dim]
            keys = blocks[:, 0].permute(1, 0, 2, 3).reshape(self.num_kv_heads, -1,
                                                             self.head_dim)[:, :length]
            values = blocks[:, 1].permute(1, 0, 2, 3).reshape(self.num_kv_heads, -1,
                                                               self.head_dim)[:, :length]
            keys = keys.repeat_interleave(groups, 0).to(q.dtype)
            values = values.repeat_interleave(groups, 0).to(q.dtype)
            query = q[at:at + rows].transpose(0, 1)  # [heads, rows, dim]
            first = length - rows  # position of the first query
            allowed = (torch.arange(length, device=q.device).unsqueeze(0)
                       <= first + torch.arange(rows, device=q.device).unsqueeze(1))
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed)
            out.append(o.transpose(0, 1).reshape(rows, -1))
            at += rows
        return torch.cat(out)
