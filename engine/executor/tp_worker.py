"""A tensor-parallel worker: builds its shard of the model, joins the group, and runs
the commands rank 0 broadcasts (engine.executor.tp_executor.serve_commands) until told to stop.

Started as `python -m engine.executor.tp_worker` with msgpack WorkerArgs on stdin (local
processes), or called as run_worker(args) inside a Ray actor.
"""
from __future__ import annotations

import logging
import sys

import msgspec
import torch

from engine.config import EngineConfig
from engine.executor.model_runner import ModelRunner
from engine.executor.parallel import ShardPlan, TPGroup
from engine.executor.tp_executor import WorkerArgs, serve_commands
from engine.model.shape import ModelShape
from engine.model.loader import load_hf_config, resolve_model
from engine.wire.curve_auth import ClientKeys

logger = logging.getLogger(__name__)


def run_worker(args: WorkerArgs) -> None:
    config = EngineConfig(**args.config)
    device = config.torch_device()
    if device.type == "cuda":
        if device.index is None:  # one GPU per rank (Ray shows each actor its own as 0)
            torch.cuda.set_device(args.rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(args.num_threads)
    dtype = config.torch_dtype(device)
    checkpoint = resolve_model(config.model, weights=config.load_format != "dummy")
    hf_config = load_hf_config(checkpoint)
    shape = ModelShape.from_hf_config(hf_config)
    tp = TPGroup(args.rank, args.size, args.rendezvous,
                 ClientKeys.from_dict(args.rendezvous_keys), device)
    try:
        runner = ModelRunner(config, shape, hf_config, checkpoint, args.max_model_len, device,
                             dtype, ShardPlan.build(shape, args.rank, args.size), tp)
        serve_commands(runner, tp)
    finally:
        tp.destroy()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="tp-worker %(levelname)s %(message)s")
    args = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerArgs)
    try:
        run_worker(args)
    except Exception as exc:  # rank 0 is gone or broke the group: nothing left to serve
        logger.warning("rank %d stopping: %s", args.rank, exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
