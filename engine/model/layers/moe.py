"""A mixture-of-experts MLP: a top-k router and the experts as one grouped computation.

Why grouped: a token's k experts differ from its neighbours', so a per-token loop would
call 2k small matmuls per token. Instead the (token, expert) pairs are sorted by expert;
each expert then multiplies one contiguous run of rows. On CPU each expert's matrices
are packed for the native kernels and each run is one call (FusedExperts.pack_weights);
elsewhere torch's grouped matmul (`torch._grouped_mm`, offsets kept on the device, so a
CUDA graph can hold it) does all of the experts in one call, and where it cannot run (a
device, dtype or shape it lacks) each expert with rows runs one matmul. No step ever
loops over tokens.

Under tensor parallelism every rank holds a column slice of every expert (gate and up
by output rows, down by input columns, like the dense MLP) and the block's output is
all-reduced; the router is replicated.

gpt-oss adds a bias to the router and to each expert's gate/up and down products (the
down bias on rank 0 only, as a row-parallel bias), and its clamped SwiGLU: with the
gate g clamped to <= limit and up to [-limit, limit], (up + 1) * g * sigmoid(alpha * g).
Its experts then multiply without the fused SiLU pass, and the activation is torch's.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import Linear, native_packs

logger = logging.getLogger(__name__)

_GROUPED: dict[tuple[str, torch.dtype], bool] = {}  # (device type, dtype) -> usable


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul runs for a device and dtype (probed once, on a
    tiny problem, and checked against a plain matmul). The runner captures CUDA graphs
    of an MoE model only where it does: the fallback reads the offsets on the host."""
    key = (device.type, dtype)
    if key not in _GROUPED:
        ok = False
        if hasattr(torch, "_grouped_mm"):
            try:  # small integers: exact in every dtype, distinct per group
                a = torch.arange(48 * 16, device=device).remainder(7).to(dtype).view(48, 16)
                b = torch.arange(3 * 16 * 16, device=device).remainder(5).to(dtype)
                b = b.view(3, 16, 16)
                offs = torch.tensor([16, 16, 48], dtype=torch.int32, device=device)
                out = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
                want = torch.cat([a[:16] @ b[0].T, a[16:] @ b[2].T])
                ok = bool(torch.equal(out, want))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        if not ok:
            logger.info("grouped matmul unavailable on %s %s: experts run one matmul each",
                        device.type, dtype)
        _GROUPED[key] = ok
    return _GROUPED[key]


def grouped_shapes_ok(*dims: int) -> bool:
    """torch's grouped matmul needs 16-byte aligned rows: every dimension a multiple of 8
    (bf16; CUDA checks it and raises otherwise)."""
    return all(d % 8 == 0 for d in dims)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e-1]:offsets[e] of x times weight[e].T, for every expert e.

    x: [N, K], sorted by expert; weight: [E, M, K]; offsets: [E] int32 cumulative ends."""
    if grouped_mm_available(x.device, x.dtype) and grouped_shapes_ok(*weight.shape[1:]):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.matmul(x[start:end], weight[e].T, out=out[start:end])
        start = end
    return out


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in float32, expert ids [T, k]): softmax over all experts in
    float32, the k largest, renormalised to sum to one where the family does."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedExperts(nn.Module):
    """Every expert's weights as two stacked tensors: w13 [E, 2I, H] holds gate then up
    rows (SwiGLU), w2 [E, H, I] the down projection; I is this rank's slice.

    On CPU, pack_weights() hands each expert's matrices to the native kernels
    (engine/model/kernels/linear.cpp), whose paired layout writes silu(gate) * up in the
    gate/up product's own pass: at W1's decode shape (~8 rows an expert) 2.2x torch's
    grouped matmul (6.1 against 13.2 ms a layer, 32 experts of 1024 x 512, Zen 4). All
    experts go in one native call a stage (grouped_linear), ~10 % under one call an
    expert at 16-64 tokens."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int,
                 biased: bool = False, down_bias: bool = True,
                 swiglu: tuple[float, float] = (0.0, 0.0)) -> None:
        """biased: gate/up and down biases b13 [E, 2I], b2 [E, H] (b2 only where
        down_bias: this rank adds it); swiglu: gpt-oss's (alpha, limit), (0, 0) for
        silu(gate) * up."""
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate = intermediate
        self.swiglu_alpha, self.swiglu_limit = swiglu
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate),
                               requires_grad=False)
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate),
                                requires_grad=False) if biased else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size),
                               requires_grad=False) if biased and down_bias else None
        self._native = None  # (kernels, [packed w13 per expert], [packed w2 per expert])

    def pack_weights(self, kernels) -> None:
        """Pack every expert for the native kernels (where they take this dtype); the
        stacked tensors are released once all are packed."""
        if self._native is not None or not native_packs(kernels, self.w13.dtype):
            return
        w13, w2 = self.w13.detach(), self.w2.detach()
        self._native = (kernels,
                        [kernels.pack_linear(w13[e].contiguous(), paired=self._fused_glu)
                         for e in range(self.num_experts)],
                        [kernels.pack_linear(w2[e].contiguous(), paired=False)
                         for e in range(self.num_experts)])
        for name in ("w13", "w2"):
            delattr(self, name)
            self.register_parameter(name, None)

    @property
    def _fused_glu(self) -> bool:
        """Whether the gate/up product can write silu(gate) * up itself (no biases, the
        plain SwiGLU)."""
        return self.b13 is None and not self.swiglu_alpha

    def _activation(self, gate_up: torch.Tensor, expert: torch.Tensor, kernels) -> torch.Tensor:
        """The gated activation of [rows, 2I] products whose rows belong to `expert`."""
        if self.b13 is not None:
            gate_up = gate_up + self.b13.index_select(0, expert).to(gate_up.dtype)
        if self.swiglu_alpha:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))
        if kernels is not None:
            return kernels.silu_and_mul(gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.silu(gate) * up

    def packed_bytes(self) -> int:
        if self._native is None:
            return 0
        return sum(w.numel() * w.element_size() for ws in self._native[1:] for w in ws)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                kernels=None) -> torch.Tensor:
        t, k = ids.shape
        flat = ids.reshape(-1)
        sorted_ids, order = torch.sort(flat, stable=True)
        token = order // k  # the token of each (token, expert) pair, in expert order
        offsets = torch.searchsorted(
            sorted_ids, torch.arange(self.num_experts, device=x.device), right=True
        ).to(torch.int32)
        rows = x.index_select(0, token)
        if self._native is not None:
            down = self._native_products(rows, offsets.tolist(), sorted_ids)
        else:
            act = self._activation(grouped_linear(rows, self.w13, offsets), sorted_ids, kernels)
            down = grouped_linear(act, self.w2, offsets)
        if self.b2 is not None:
            down = down + self.b2.index_select(0, sorted_ids).to(down.dtype)
        # back in (token, k) order, then each token's k products weighted and summed in a
        # fixed order (an index_add_ would sum them with atomics on CUDA: run to run,
        # and graph to eager, the order and so the rounding would change)
        unsorted = torch.empty_like(down)
        unsorted[order] = down
        mixed = unsorted.view(t, k, -1).float().mul_(weights.unsqueeze(-1)).sum(dim=1)
        return mixed.to(x.dtype)

    def _native_products(self, rows: torch.Tensor, ends: list[int],
                         expert: torch.Tensor) -> torch.Tensor:
        """Each expert's run of rows through its packed gate/up (SiLU x up fused where
        the experts' activation is the plain one), then its down: one native call a stage
        for all experts (its threads prefetch the next expert's panels while they
        multiply this one's)."""
        kernels, w13, w2 = self._native
        if self._fused_glu:
            act = kernels.grouped_linear(rows, w13, ends, 2 * self.intermediate, paired=True,
                                         glu=True)
        else:
            act = self._activation(
                kernels.grouped_linear(rows, w13, ends, 2 * self.intermediate), expert,
                kernels)
        return kernels.grouped_linear(act, w2, ends, self.hidden_size)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token runs beside the routed experts (Qwen2-MoE), scaled
    by sigmoid(shared_expert_gate(x)); this rank's columns of it, summed with the
    experts' output before the block's one all-reduce."""

    def __init__(self, hidden_size: int, intermediate: int, kernels=None) -> None:
        super().__init__()
        self.intermediate, self.kernels = intermediate, kernels
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate, bias=False)
        self.gate_up_proj.glu_halves = True
        self.down_proj = Linear(intermediate, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.fuses_glu:
            return self.down_proj(self.gate_up_proj.forward_glu(x))
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """The router (`gate`, a linear to one logit per expert), the experts, and where the
    family has one the shared expert with its gate."""

    lora = None  # attach_lora sets these on every MLP; adapters never reach the experts
    layer_index = 0

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate: int,
                 renormalize: bool, tp=None, kernels=None, shared_intermediate: int = 0,
                 biased: bool = False, swiglu: tuple[float, float] = (0.0, 0.0)) -> None:
        """biased / swiglu: gpt-oss's router and expert biases and clamped SwiGLU
        (FusedExperts)."""
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.tp, self.kernels = tp, kernels
        self.gate = Linear(hidden_size, num_experts, bias=biased)
        rank0 = tp is None or tp.rank == 0
        self.experts = FusedExperts(num_experts, hidden_size, intermediate, biased, rank0,
                                    swiglu)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate, kernels)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids, self.kernels)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.tp is not None else out


__all__ = ["FusedExperts", "SharedExpert", "SparseMoeBlock", "grouped_linear",
           "grouped_mm_available", "grouped_shapes_ok", "route"]
