"""A Mamba-2 mixer over per-request states kept in the paged cache's blocks.

Each request of a hybrid model holds one state block (engine.core.kv_cache_manager): in
every mixer layer, that block of the layer's cache tensor holds the request's
convolution state (the last d_conv - 1 inputs) and SSM state [heads, head_dim, d_state]
(state_views carves them out of the block; the engine sized blocks so that they fit).
A request's first chunk starts from zeros; later chunks and decode steps continue from
the state the previous step left, so chunked prefill carries it across chunks.

- Decode rows (one token a sequence) update all their sequences' states at once: one
  step of the convolution and of the recurrence h = exp(dt A) h + dt x B^T, y = C h + D x.
- A prefill chunk runs the causal convolution over [its conv state, the chunk] and the
  SSM in its chunked (SSD) form: within a block of tokens the outputs are a masked
  matrix product with decays exp(cumsum(dt A)) between positions, and the state passes
  from block to block; in float32 throughout.
- The output is RMS-normalised in groups after the gate, y * silu(z), then projected.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import Linear
from engine.model.shape_parts import MambaShape

_SCAN_BLOCK = 128  # tokens of a prefill chunk scanned as one matrix product


@dataclass
class StateMetadata:
    """A step's sequences as the mixers see them, in batch order (decodes first)."""

    slots: torch.Tensor  # [S] int64 each sequence's state block
    query_lens: list[int]
    fresh: list[bool]  # its chunk starts at position 0: its state starts from zeros
    num_decodes: int


def state_views(layer_cache: torch.Tensor, num_blocks: int, m: MambaShape
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv [blocks, d_conv - 1, conv_dim], ssm [blocks, heads, head_dim, d_state]) views
    of one layer's cache tensor, whatever its attention layout: a block's page is its
    share of the tensor's elements."""
    flat = layer_cache.reshape(-1)
    page = flat.numel() // num_blocks
    conv_elems = (m.d_conv - 1) * m.conv_dim
    if conv_elems + m.num_heads * m.head_dim * m.d_state > page:
        raise ValueError(f"a state of {m.state_elements} elements does not fit a block's "
                         f"{page}: the block size was not aligned to the state")
    pages = flat[:num_blocks * page].view(num_blocks, page)
    conv = pages[:, :conv_elems].view(num_blocks, m.d_conv - 1, m.conv_dim)
    ssm = pages[:, conv_elems:conv_elems + m.num_heads * m.head_dim * m.d_state]
    return conv, ssm.view(num_blocks, m.num_heads, m.head_dim, m.d_state)


class MambaMixer(nn.Module):
    def __init__(self, hidden_size: int, m: MambaShape, eps: float) -> None:
        super().__init__()
        self.m, self.eps = m, eps
        inner = m.intermediate_size
        self.in_proj = Linear(hidden_size, inner + m.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d_weight = nn.Parameter(torch.empty(m.conv_dim, 1, m.d_conv),
                                          requires_grad=False)
        self.conv1d_bias = nn.Parameter(torch.empty(m.conv_dim), requires_grad=False) \
            if m.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(m.num_heads), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(inner), requires_grad=False)
        self.out_proj = Linear(inner, hidden_size, bias=m.proj_bias)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                meta: StateMetadata) -> torch.Tensor:
        m = self.m
        inner = m.intermediate_size
        z, xbc, dt = self.in_proj(x).split([inner, m.conv_dim, m.num_heads], dim=-1)
        conv_state, ssm_state = state
        y = torch.empty(x.shape[0], inner, dtype=torch.float32, device=x.device)
        d = meta.num_decodes
        if d:
            y[:d] = self._decode(xbc[:d], dt[:d], conv_state, ssm_state, meta.slots[:d])
        start = d
        for i in range(d, len(meta.query_lens)):
            n = meta.query_lens[i]
            slot = meta.slots[i]
            if meta.fresh[i]:
                conv_state[slot].zero_()
                ssm_state[slot].zero_()
            y[start:start + n] = self._prefill(xbc[start:start + n], dt[start:start + n],
                                               conv_state, ssm_state, slot)
            start += n
        return self.out_proj(self._gated_norm(y, z).to(x.dtype))

    def _conv_out(self, windows: torch.Tensor) -> torch.Tensor:
        """Depthwise causal convolution of [rows, d_conv, C] input windows, then SiLU."""
        w = self.conv1d_weight[:, 0, :].float()  # [C, d_conv]
        out = torch.einsum("rkc,ck->rc", windows.float(), w)
        if self.conv1d_bias is not None:
            out = out + self.conv1d_bias.float()
        return F.silu(out)

    def _split(self, xbc: torch.Tensor, dt: torch.Tensor):
        """x [n, heads, head_dim], B and C [n, heads, d_state] (groups repeated to heads),
        dt [n, heads] after softplus and the limits, all float32."""
        m = self.m
        inner, gs = m.intermediate_size, m.num_groups * m.d_state
        xs, b, c = xbc.split([inner, gs, gs], dim=-1)
        rep = m.num_heads // m.num_groups
        b = b.reshape(-1, m.num_groups, m.d_state).repeat_interleave(rep, 1)
        c = c.reshape(-1, m.num_groups, m.d_state).repeat_interleave(rep, 1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(m.dt_min, m.dt_max)
        return xs.reshape(-1, m.num_heads, m.head_dim), b, c, dt

    def _decode(self, xbc, dt, conv_state, ssm_state, slots) -> torch.Tensor:
        windows = torch.cat([conv_state[slots].float(), xbc.float().unsqueeze(1)], dim=1)
        conv_state[slots] = windows[:, 1:].to(conv_state.dtype)
        xs, b, c, dt = self._split(self._conv_out(windows), dt)
        a = -torch.exp(self.A_log.float())
        h = ssm_state[slots].float()  # [S, heads, head_dim, d_state]
        h = h * torch.exp(dt * a)[..., None, None] + \
            (dt[..., None] * xs)[..., None] * b[:, :, None, :]
        ssm_state[slots] = h.to(ssm_state.dtype)
        y = torch.einsum("shpn,shn->shp", h, c) + self.D.float()[:, None] * xs
        return y.reshape(xs.shape[0], -1)

    def _prefill(self, xbc, dt, conv_state, ssm_state, slot) -> torch.Tensor:
        m, n = self.m, xbc.shape[0]
        seq = torch.cat([conv_state[slot].float(), xbc.float()], dim=0)  # [K - 1 + n, C]
        conv_state[slot] = seq[-(m.d_conv - 1):].to(conv_state.dtype)
        windows = seq.unfold(0, m.d_conv, 1).transpose(1, 2)  # [n, d_conv, C]
        xs, b, c, dt = self._split(self._conv_out(windows), dt)
        a = -torch.exp(self.A_log.float())
        h = ssm_state[slot].float()
        ys = []
        for lo in range(0, n, _SCAN_BLOCK):
            hi = min(n, lo + _SCAN_BLOCK)
            y, h = _scan_block(xs[lo:hi], b[lo:hi], c[lo:hi], dt[lo:hi], a, h)
            ys.append(y)
        ssm_state[slot] = h.to(ssm_state.dtype)
        y = torch.cat(ys) + self.D.float()[:, None] * xs
        return y.reshape(n, -1)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMS norm of y * silu(z) within each of the groups, times the weight (float32)."""
        g = y * F.silu(z.float())
        groups = g.view(g.shape[0], self.m.num_groups, -1)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return groups.view_as(g) * self.norm_weight.float()


def _scan_block(x, b, c, dt, a, h):
    """The SSM over one block of n tokens from state h [heads, head_dim, d_state]:
    y_t = sum_{s<=t} exp(L_t - L_s) (C_t . B_s) dt_s x_s + exp(L_t) C_t h, L = cumsum(dt a);
    returns (y [n, heads, head_dim], the state after the block)."""
    log_decay = torch.cumsum(dt * a, dim=0)  # [n, heads]
    seg = log_decay[:, None, :] - log_decay[None, :, :]  # [t, s, heads]
    n = x.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[..., None], float("-inf")))
    weights = torch.einsum("thn,shn->tsh", c, b) * decay
    y = torch.einsum("tsh,shp->thp", weights, dt[..., None] * x)
    y = y + torch.exp(log_decay)[..., None] * torch.einsum("thn,hpn->thp", c, h)
    last = log_decay[-1]
    carried = torch.exp(last - log_decay)  # [s, heads]
    h = torch.exp(last)[:, None, None] * h + torch.einsum(
        "sh,shp,shn->hpn", carried * dt, x, b)
    return y, h


__all__ = ["MambaMixer", "StateMetadata", "state_views"]
