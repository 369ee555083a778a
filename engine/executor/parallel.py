"""Tensor parallelism: how a model is split over ranks, and the collectives between them.

ShardPlan says which heads, MLP columns and vocabulary rows a rank owns (the same
arithmetic on every rank and in the weight loader). TPGroup wraps torch.distributed:
gloo on CPU; on CUDA nccl for the tensors plus a gloo group for the host-side step
messages. A TP size of 1 uses neither: the model calls into TPGroup only when
size > 1.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError
from engine.wire.curve_auth import ClientKeys


@dataclass(frozen=True)
class ShardPlan:
    """One rank's share of a model under tensor parallelism.

    Query heads and MLP columns (every expert's too) are split evenly. KV heads are
    split when there are at least as many as ranks, else each is replicated on
    size // num_kv_heads ranks.
    The vocabulary is split in equal padded slices (the last one may hold padding
    rows, whose logits are dropped).
    """

    rank: int
    size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's kv heads
    kv_head_start: int  # first kv head of the checkpoint this rank holds
    intermediate_size: int
    vocab_per_rank: int
    expert_intermediate_size: int = 0  # each expert's columns on this rank (MoE models)
    shared_intermediate_size: int = 0  # the shared expert's columns on this rank

    @classmethod
    def build(cls, shape, rank: int, size: int) -> "ShardPlan":
        """shape: the model's ModelShape. Raises InvalidRequestError naming what does not
        divide."""
        check_divisible(shape, size)
        kv = shape.num_kv_heads
        if kv >= size:
            local_kv, kv_start = kv // size, rank * (kv // size)
        else:
            local_kv, kv_start = 1, rank // (size // kv)
        return cls(rank=rank, size=size, num_heads=shape.num_heads // size,
                   num_kv_heads=local_kv, kv_head_start=kv_start,
                   intermediate_size=shape.intermediate_size // size,
                   vocab_per_rank=-(-shape.vocab_size // size),
                   expert_intermediate_size=(shape.moe.intermediate_size // size
                                             if shape.moe is not None else 0),
                   shared_intermediate_size=(shape.moe.shared_intermediate_size // size
                                             if shape.moe is not None else 0))

    @property
    def head_start(self) -> int:
        return self.rank * self.num_heads

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank


def check_divisible(shape, size: int) -> None:
    """The model can be split over `size` ranks, else a clear InvalidRequestError."""
    if size < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be >= 1, got {size}")
    problems = []
    if shape.num_heads % size:
        problems.append(f"{shape.num_heads} attention heads")
    kv = shape.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"{kv} kv heads (need a multiple or a divisor of the TP size)")
    if shape.intermediate_size % size:
        problems.append(f"MLP width {shape.intermediate_size}")
    moe = getattr(shape, "moe", None)
    if moe is not None and moe.intermediate_size % size:
        problems.append(f"expert width {moe.intermediate_size}")
    if moe is not None and moe.shared_intermediate_size % size:
        problems.append(f"shared expert width {moe.shared_intermediate_size}")
    if problems:
        raise InvalidRequestError(
            f"tensor_parallel_size={size} does not divide the model: {', '.join(problems)}")


class TPGroup:
    """The process group of one engine's TP ranks (rank 0 lives in the engine core)."""

    def __init__(self, rank: int, size: int, rendezvous: str, keys: ClientKeys,
                 device: torch.device, timeout_s: float = 120.0) -> None:
        """rendezvous, keys: rank 0's RendezvousServer address and the CURVE client keys
        it admits (engine.executor.rendezvous: why not torch's open TCPStore)."""
        import torch.distributed as dist

        from engine.executor.rendezvous import RendezvousStore
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = RendezvousStore(rendezvous, keys, timeout_s)
        try:
            dist.init_process_group(backend, store=self._store, rank=rank, world_size=size,
                                    timeout=timeout)
        except Exception:
            self._store.close()
            raise
        # host-side messages (the scheduled batch) always travel over gloo
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) \
            if backend != "gloo" else dist.group.WORLD
        self._dist = dist

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place."""
        self._dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's x along the last dim on rank 0 (None elsewhere)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self._dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends payload to every rank; returns it on all ranks.

        Two gloo broadcasts: the length, then the bytes (a step's batch description is
        a few KB; measured cost in docs/benchmarks.md)."""
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self._dist.broadcast(length, src=0, group=self.cpu_group)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
        self._dist.broadcast(buf, src=0, group=self.cpu_group)
        return payload if self.rank == 0 else buf.numpy().tobytes()

    def gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's values on rank 0 (None elsewhere)."""
        t = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        self._dist.gather(t, parts, dst=0, group=self.cpu_group)
        return [p.tolist() for p in parts] if parts is not None else None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV blocks that fit on all of them)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def destroy(self) -> None:
        try:
            self._dist.destroy_process_group()
        except Exception:  # the group may already be broken by a dead peer
            pass
        self._store.close()
