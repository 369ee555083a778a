"""AttentionBackend: everything the engine asks of an attention backend, so that no
caller tests a backend's name or which field of a metadata is set.

The runner chooses one backend (registry.make_backend) and asks it what it refuses,
how its KV cache is laid out and held, which kernels run the layers beside it, whether
decode steps replay CUDA graphs and with what metadata; the step inputs ask it for a
step's metadata, the KV budget for a block's bytes and a cap on blocks, and each
attention layer calls `meta.backend.forward`: every metadata carries the backend that
built it, so the model never learns which one runs.

AttentionSpec is what a backend is asked to serve, AttentionMetadata what every
backend's step metadata has in common (each backend extends it with its own fields),
AttentionLayer what a backend reads off a layer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

import torch

from engine.model.shape import ModelShape

if TYPE_CHECKING:
    from engine.model.layers.rotary import Rope


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend is asked to serve and where: one runner's model, device and cache
    (this rank's heads under tensor parallelism). Its refusals read it before it is
    built; its constructor reads it after."""

    shape: ModelShape
    device: torch.device
    kernels: Any  # the compiled CPU kernels module (engine.model.kernels), or None
    kv_cache_dtype: str  # the option's value: auto (the activation dtype), fp8, fp8_e4m3
    block_size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's kv heads
    decode_sizes: tuple[int, ...] = (1,)  # the captured decode batch sizes, ascending
    max_pages: int = 1  # the longest block table

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the KV cache, as every backend's metadata says it.

    The batch holds the num_decodes single-token queries first, then the prefill
    chunks. Each backend's metadata (native.NativeMetadata, torch_sdpa.TorchMetadata,
    flex.FlexMetadata, triton.TritonMetadata) adds what its forward reads; the fields
    below are the runner's and the model's, keyword-only so that a subclass's own
    fields follow slot_mapping and num_decodes in its constructor."""

    slot_mapping: torch.Tensor  # [T] int64 flat slot index (block * block_size + offset)
    num_decodes: int
    backend: AttentionBackend | None = field(default=None, kw_only=True)  # who built it
    state: Any = field(default=None, kw_only=True)  # a hybrid's Mamba states (StateMetadata)
    # several KV groups: each group's metadata (this one first), picked per layer
    groups: list | None = field(default=None, kw_only=True)
    # every token is a generated one (decodes, and verified proposals: engine/spec_decode),
    # none a prompt's: the linears and the LM head take the decode path's products
    generated_only: bool = field(default=False, kw_only=True)


# (batch size, positions, slots, context lengths, block tables [size, width]) -> the
# metadata of a captured decode batch, built from the graph's static input buffers
GraphMetadata = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                         AttentionMetadata]


class AttentionLayer(Protocol):
    """What a backend reads off an attention layer (engine.model.families.base.Attention)."""

    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    scale: float
    k_scale: float  # an fp8 cache's per-layer scales (1.0 otherwise)
    v_scale: float
    window: int  # the sliding window (0: none)
    sinks: torch.Tensor | None  # attention sinks [H], or None

    def normed_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """The fused qkv rows with q and k normalised where the layer has q/k norms."""

    def rotated(self, qkv: torch.Tensor,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D]: normalised and rotated, views of qkv where
        the layer's kernels rotate in place."""


class AttentionBackend(ABC):
    """One way of attending over the paged KV cache. Subclasses set `name` (the
    attention_backend option's value) and the capability flags, and implement the
    cache layout, the step metadata and the forward."""

    name: ClassVar[str]
    # decode steps may replay CUDA graphs (graph_metadata builds a captured batch's)
    graphs: ClassVar[bool] = False
    # engine.model.stack's one native call may run the layers: it reads this backend's
    # metadata (block tables, lengths and row offsets of every sequence)
    runs_stack: ClassVar[bool] = False
    # its own kernels run the layers' element-wise work and quantized linears (Triton):
    # the CPU kernels then neither pack the linears nor multiply quantized weights
    own_layer_kernels: ClassVar[bool] = False
    # on CPU the pool is mapped lazily zeroed and the runner backs its first blocks
    # before ready (the CPU backends; the others' CPU runs are tests: torch.zeros)
    lazy_cpu_pool: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec
        self.device = spec.device
        self.block_size = spec.block_size

    # ---- what it serves ---------------------------------------------------------------
    @classmethod
    def refuses(cls, spec: AttentionSpec) -> str | None:
        """Why it cannot serve this model on this device (the error's whole message), or
        None. `auto` passes over a backend that refuses; a backend named is refused."""
        return None

    @classmethod
    def refuses_cache(cls, spec: AttentionSpec) -> str | None:
        """Why it cannot hold the cache the options ask for (kv_cache_dtype, block_size),
        or None. Asked of the chosen backend only: `auto` does not change kernels for a
        cache option, the option is the user's to change."""
        return None

    # ---- the KV cache -----------------------------------------------------------------
    @abstractmethod
    def cache_shape(self, slots: int, num_blocks: int) -> tuple[int, ...]:
        """The whole pool's shape: `slots` layers' caches (engine.core.kv_groups) of
        num_blocks blocks each."""

    @abstractmethod
    def cache_views(self, layer_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cache tensor as the (keys, values) views its forward reads."""

    def cache_allocated(self, num_blocks: int) -> None:
        """The pool now holds num_blocks blocks (what a backend keeps beside it)."""

    def cache_freed(self) -> None:
        """The pool is gone: drop what cache_allocated kept."""

    def cache_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The cache's element type: the activation dtype, or e4m3 for kv_cache_dtype fp8
        (read by the native CPU kernel, the Triton kernels and the torch path; a backend
        that cannot read it refused it in refuses_cache)."""
        return activations if self.spec.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def block_bytes(self, slots: int, dtype: torch.dtype) -> int:
        """Bytes of one KV block across the pool's slots: keys and values of every kv
        head of this rank."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * slots * self.block_size * self.spec.num_kv_heads * self.spec.head_dim * elem

    def max_blocks(self) -> int | None:
        """The most blocks its kernels can address, or None for no limit."""
        return None

    # ---- the layers' other kernels ------------------------------------------------------
    def layer_ops(self, kernels: Any) -> Any:
        """The fused element-wise ops the layers run (norms, rotary, SiLU): by default
        the CPU kernels (or None: torch ops)."""
        return kernels

    def weight_holder(self, fmt: str, dtype: torch.dtype) -> Any:
        """A WeightHolder (engine.quant.held) of its own kernels for a quantized
        checkpoint of format fmt, or None (the weights are then decoded at load)."""
        return None

    # ---- a step -----------------------------------------------------------------------
    @abstractmethod
    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       tables: list[list[int]], slot_mapping: torch.Tensor,
                       num_decodes: int) -> AttentionMetadata:
        """A step's metadata over one KV group: each sequence's new tokens, its context
        after the step, its block table; the tokens' cache slots; the leading decodes."""

    def prepare_step(self, meta: AttentionMetadata, positions: torch.Tensor) -> None:
        """Once a step before the layers run, with its tokens' positions."""

    def graph_metadata(self) -> GraphMetadata:
        """The metadata builder of a captured decode batch (engine.executor.cuda_graphs);
        only where `graphs`."""
        raise NotImplementedError(f"attention backend {self.name!r} captures no CUDA graphs")

    @abstractmethod
    def forward(self, layer: AttentionLayer, qkv: torch.Tensor, rope: Rope,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """One layer: its fused qkv rows [T, (H + 2 KVH) * D] (projected, not yet
        normalised or rotated) -> attention output [T, H * D], this step's keys and
        values written into kv_cache (the layer's views) first."""


__all__ = ["AttentionBackend", "AttentionLayer", "AttentionMetadata", "AttentionSpec",
           "GraphMetadata"]
