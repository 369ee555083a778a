"""TPExecutor: one engine's model over tensor_parallel_size ranks.

Rank 0 is the engine-core process itself (it prepares each step and samples);
ranks 1..N-1 are workers started by a launcher: local processes by default
(ProcessLauncher), Ray actors in the engine replica's placement group when served
(deployments.serve.tp_workers). Every call the engine core makes on its model runner
goes through here: rank 0 first broadcasts a small msgpack message (the step's
StepInput, or a sleep/wake/allocate command) over gloo, then all ranks run it.

A dead worker breaks the group's connections, so the next collective fails at
once; the executor then raises EngineDeadError naming the rank, and every later
call does the same (the engine core fails its requests and stops).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch

from engine.config import EngineConfig, default_num_threads
from engine.core.scheduler import SchedulerOutput
from engine.errors import EngineDeadError, InvalidRequestError
from engine.executor.model_runner import ModelRunner
from engine.executor.step_inputs import StepInput, StepResult
from engine.executor.parallel import ShardPlan, TPGroup, check_divisible
from engine.executor.rendezvous import RendezvousServer
from engine.lora.adapter import LoRAError
from engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)
# How long a failed collective waits for the launcher to report which worker ended.
_DEATH_REPORT_GRACE_S = 2.0


class WorkerArgs(msgspec.Struct):
    """What a worker needs to build its shard and join the group.

    rendezvous_keys are the CURVE client keys of rank 0's rendezvous
    (engine.executor.rendezvous): they travel in the Ray actor call or on a local
    worker's stdin, and repr leaves them out, so a logged WorkerArgs shows no secret."""

    config: dict[str, Any]  # EngineConfig fields
    rank: int
    size: int
    rendezvous: str  # tcp://host:port of rank 0's RendezvousServer
    rendezvous_keys: dict[str, str]  # ClientKeys.as_dict()
    max_model_len: int
    num_threads: int

    def __repr__(self) -> str:
        return (f"WorkerArgs(rank={self.rank}, size={self.size}, "
                f"rendezvous={self.rendezvous!r}, rendezvous_keys=<hidden>, "
                f"max_model_len={self.max_model_len}, num_threads={self.num_threads})")


class Command(msgspec.Struct, array_like=True, gc=False):
    """Rank 0 -> workers, once per call: kind plus its argument."""

    kind: str  # step | blocks | alloc | free_kv | free_weights | restore | memory | lora |
    # drop_lora | stop
    step: StepInput | None = None
    value: int = 0
    lora: LoRARequest | None = None


class WorkerLauncher(Protocol):
    """Starts ranks 1..N-1 (its optional `host` attribute is rank 0's address for them)."""

    def start(self, workers: list[WorkerArgs]) -> None: ...
    def dead(self) -> dict[int, str]:
        """Ranks whose worker has ended, with why."""
    def stop(self) -> None: ...


class ProcessLauncher:
    """Workers as child processes (`python -m engine.executor.tp_worker`), arguments on stdin.

    A fresh interpreter rather than multiprocessing: user scripts need no
    `if __name__ == "__main__"` guard, and nothing of the parent is inherited."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, workers: list[WorkerArgs]) -> None:
        for args in workers:
            proc = subprocess.Popen([sys.executable, "-m", "engine.executor.tp_worker"],
                                    stdin=subprocess.PIPE, env=_worker_env(args))
            proc.stdin.write(msgspec.msgpack.encode(args))
            proc.stdin.close()
            self.procs[args.rank] = proc

    def dead(self) -> dict[int, str]:
        return {rank: f"exit code {p.returncode}" for rank, p in self.procs.items()
                if p.poll() is not None}

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _stop_all(launcher: WorkerLauncher, rendezvous: RendezvousServer) -> None:
    launcher.stop()
    rendezvous.stop()


def _worker_env(args: WorkerArgs) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.num_threads))
    # the worker imports this package the way the parent did
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env



class TPExecutor:
    """The model-runner interface of EngineCore, spread over TP ranks."""

    def __init__(self, config: EngineConfig, shape, hf_config, checkpoint, max_model_len: int,
                 device: torch.device, dtype: torch.dtype,
                 launcher: WorkerLauncher | None = None) -> None:
        size = config.tensor_parallel_size
        check_divisible(shape, size)
        self.size = size
        if launcher is None and device.type == "cuda" and size > torch.cuda.device_count():
            raise InvalidRequestError(
                f"tensor_parallel_size={size} needs {size} GPUs; this machine has "
                f"{torch.cuda.device_count()}")
        self.launcher = launcher or ProcessLauncher()
        self._dead: EngineDeadError | None = None
        threads = config.num_threads or max(1, default_num_threads() // size)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        host = getattr(self.launcher, "host", "127.0.0.1")  # where workers reach rank 0
        self.rendezvous = RendezvousServer(host)
        keys = self.rendezvous.client_keys()
        workers = [WorkerArgs(asdict(config), rank, size, self.rendezvous.address,
                              keys.as_dict(), max_model_len, threads)
                   for rank in range(1, size)]
        self._finalizer = weakref.finalize(self, _stop_all, self.launcher, self.rendezvous)
        self.launcher.start(workers)
        try:
            self.tp = TPGroup(0, size, self.rendezvous.address, keys, device)
            self.runner = ModelRunner(config, shape, hf_config, checkpoint, max_model_len,
                                      device, dtype, ShardPlan.build(shape, 0, size), self.tp)
        except Exception:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (%s)", size, type(self.launcher).__name__)

    # ---- messaging ----------------------------------------------------------------------
    def _send(self, command: Command) -> None:
        self._call(self.tp.broadcast_bytes, msgspec.msgpack.encode(command))

    def _call(self, fn, *args):
        """Run a collective; a failure means a rank is gone: the engine is dead."""
        if self._dead is not None:
            raise self._dead
        try:
            return fn(*args)
        except Exception as exc:
            dead = self._wait_for_dead_worker()
            why = ", ".join(f"rank {r} ({w})" for r, w in sorted(dead.items()))
            self._dead = EngineDeadError(
                f"tensor-parallel worker {why} died" if dead else
                f"tensor-parallel collective failed: {exc}")
            logger.error("%s", self._dead)
            raise self._dead from exc

    def _wait_for_dead_worker(self) -> dict[int, str]:
        """The ranks that ended, waiting briefly: a killed worker's sockets are reset
        while it exits, so the collective can fail before its process is reported gone."""
        deadline = time.monotonic() + _DEATH_REPORT_GRACE_S
        dead = self.launcher.dead()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.launcher.dead()
        return dead

    # ---- the ModelRunner interface --------------------------------------------------------
    @property
    def kv_caches(self) -> torch.Tensor | None:
        return self.runner.kv_caches

    def max_kv_blocks(self) -> int:
        self._send(Command("blocks"))
        return self._call(self.tp.min_int, self.runner.max_kv_blocks())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._send(Command("alloc", value=num_blocks))
        self.runner.allocate_kv_cache(num_blocks)

    def free_kv_cache(self) -> None:
        self._send(Command("free_kv"))
        self.runner.free_kv_cache()

    def has_weights(self) -> bool:
        return self.runner.has_weights()

    def offload_weights(self) -> None:
        self._send(Command("offload"))
        self.runner.offload_weights()

    def free_weights(self) -> None:
        self._send(Command("free_weights"))
        self.runner.free_weights()

    def restore_weights(self) -> None:
        self._send(Command("restore"))
        self.runner.restore_weights()  # loading the shards runs no collective

    def memory_usage(self) -> dict[str, Any]:
        """Rank 0's bytes, plus every rank's weight and KV bytes."""
        self._send(Command("memory"))
        mine = self.runner.memory_usage()
        per_rank = self._call(self.tp.gather_ints, [mine["weights_bytes"],
                                                    mine["kv_cache_bytes"]])
        return {**mine, "per_rank_weights_bytes": [r[0] for r in per_rank],
                "per_rank_kv_cache_bytes": [r[1] for r in per_rank]}

    def check_lora(self, request: LoRARequest) -> None:
        self.runner.check_lora(request)  # rank 0 validates; each rank reads its slice

    def load_lora(self, slot: int, request: LoRARequest) -> None:
        """Every rank reads its slice into the slot; a rank that cannot is named in a
        LoRAError (the ranks stay in step: each reports, none raises alone)."""
        self._send(Command("lora", value=slot, lora=request))
        error = None
        try:
            self.runner.load_lora(slot, request)
        except Exception as exc:  # noqa: BLE001 - reported below, after the gather
            error = exc
        oks = self._call(self.tp.gather_ints, [0 if error else 1])
        failed = [rank for rank, ok in enumerate(oks) if not ok[0]]
        if failed:
            raise LoRAError(f"TP ranks {failed} could not load the adapter "
                            f"{request.lora_name!r}" + (f": {error}" if error else ""))

    def drop_lora(self, lora_id: int) -> None:
        self._send(Command("drop_lora", value=lora_id))
        self.runner.drop_lora(lora_id)

    def execute(self, sched: SchedulerOutput) -> StepResult:
        step, rows = self.runner.prepare(sched)
        self._send(Command("step", step=step))
        return StepResult.build(step, rows, *self._call(self.runner.run, step))

    def shutdown(self) -> None:
        """Stop the workers (a stop message if the group still works, then the launcher)."""
        if self._dead is None and getattr(self, "tp", None) is not None:
            try:
                self.tp.broadcast_bytes(msgspec.msgpack.encode(Command("stop")))
            except Exception:
                pass
            self._dead = EngineDeadError("the engine was shut down")
        self._finalizer()
        if getattr(self, "tp", None) is not None:
            self.tp.destroy()


def serve_commands(runner: ModelRunner, tp: TPGroup) -> None:
    """A worker's loop: run what rank 0 broadcasts until it says stop."""
    decoder = msgspec.msgpack.Decoder(Command)
    while True:
        command = decoder.decode(tp.broadcast_bytes(None))
        kind = command.kind
        if kind == "step":
            runner.run(command.step)
        elif kind == "blocks":
            tp.min_int(runner.max_kv_blocks())
        elif kind == "alloc":
            runner.allocate_kv_cache(command.value)
        elif kind == "free_kv":
            runner.free_kv_cache()
        elif kind == "offload":
            runner.offload_weights()
        elif kind == "free_weights":
            runner.free_weights()
        elif kind == "restore":
            runner.restore_weights()
        elif kind == "memory":
            usage = runner.memory_usage()
            tp.gather_ints([usage["weights_bytes"], usage["kv_cache_bytes"]])
        elif kind == "lora":
            try:
                runner.load_lora(command.value, command.lora)
                ok = 1
            except Exception:  # noqa: BLE001 - rank 0 names this rank and fails the requests
                logger.exception("rank %d: loading LoRA adapter %r failed", tp.rank,
                                 command.lora.lora_name)
                ok = 0
            tp.gather_ints([ok])
        elif kind == "drop_lora":
            runner.drop_lora(command.value)
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown command {kind!r}")
