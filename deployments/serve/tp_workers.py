"""Tensor-parallel workers as Ray actors in the engine replica's placement group.

The EngineServer replica is TP rank 0 (it sits in bundle 0); ranks 1..N-1 are
TPWorker actors pinned to bundles 1..N-1, each with that bundle's CPUs/GPU. They
run engine.executor.tp_worker.run_worker, the same loop as local worker processes.
"""
from __future__ import annotations

import logging

import msgspec
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.executor.tp_executor import WorkerArgs

logger = logging.getLogger(__name__)


@ray.remote(max_restarts=0)
class TPWorker:
    """One TP rank; run() blocks for the worker's life and returns when rank 0 stops it."""

    def run(self, args: bytes) -> None:
        from engine.executor.tp_worker import run_worker
        run_worker(msgspec.msgpack.decode(args, type=WorkerArgs))


class RayWorkerLauncher:
    """engine.executor.tp_executor.WorkerLauncher for Ray: actors in the current placement group."""

    def __init__(self, num_cpus: float, num_gpus: float) -> None:
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.host = ray.util.get_node_ip_address()  # rank 0's rendezvous address
        self.placement_group = ray.util.get_current_placement_group()
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.runs: dict[int, ray.ObjectRef] = {}

    def start(self, workers: list[WorkerArgs]) -> None:
        for args in workers:
            strategy = None
            if self.placement_group is not None:
                strategy = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=args.rank,
                    placement_group_capture_child_tasks=False)
            actor = TPWorker.options(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=strategy,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(args.num_threads)}},
            ).remote()
            self.actors[args.rank] = actor
            self.runs[args.rank] = actor.run.remote(msgspec.msgpack.encode(args))

    def dead(self) -> dict[int, str]:
        if not self.runs:
            return {}
        ready, _ = ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=0)
        out = {}
        for rank, ref in self.runs.items():
            if ref in ready:
                try:
                    ray.get(ref)
                    out[rank] = "stopped"
                except Exception as exc:  # the actor died or its loop raised
                    out[rank] = type(exc).__name__
        return out

    def stop(self) -> None:
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors.clear()
