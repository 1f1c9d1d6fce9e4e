"""The body of a spawned TP rank process (ranks 1..tp-1), and process-group setup
shared with rank 0.

A rank loads only its shard, builds a `ModelRunner` over its slice of the KV heads, says
`RankReady`, then obeys rank 0's pipe: each `RunStep` is decoded against the sequences
the rank holds (`StepDecoder`, parallel/step_delta.py) into the step's `SchedulerOutput`,
and runs the same forward (and logits collectives) as rank 0, without sampling. It exits
on `Shutdown`, when rank 0's end of the pipe closes (rank 0 died), or on any error (after
a `RankFailed`): a rank whose state is uncertain must not run another collective, and its
exit makes the others' collectives fail at once instead of hanging.
"""

from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from workers.engine.parallel.messages import (
    BlocksRead,
    RankFailed,
    RankReady,
    RankSpec,
    ReadBlocks,
    RunStep,
    Shutdown,
    WriteBlocks,
)
from workers.engine.parallel.step_delta import StepDecoder

logger = logging.getLogger(__name__)


def init_distributed(spec: RankSpec) -> None:
    """Join the group's process group (blocks until every rank has joined)."""
    import torch
    import torch.distributed as dist

    kind = spec.device.split(":", 1)[0]
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)
    if ":" in spec.device:  # a device per rank before any collective touches it
        index = int(spec.device.split(":", 1)[1])
        getattr(torch, kind).set_device(index)
    dist.init_process_group(spec.dist_backend, init_method=spec.init_method,
                            world_size=spec.tp_size, rank=spec.tp_rank,
                            timeout=timedelta(seconds=spec.timeout_seconds))


def build_runner(spec: RankSpec, *, with_tokenizer: bool) -> Any:
    """This rank's shard of the model and its `ModelRunner`."""
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    loaded = load_checkpoint(spec.model_dir, dtype=spec.dtype, device=spec.device,
                             tp_size=spec.tp_size, tp_rank=spec.tp_rank,
                             with_tokenizer=with_tokenizer)
    return ModelRunner(loaded, block_size=spec.block_size, kv_cache_bytes=spec.kv_cache_bytes,
                       max_num_batched_tokens=spec.max_num_batched_tokens,
                       max_num_seqs=spec.max_num_seqs)


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """Entry point of a spawned rank process."""
    # NOTE: rank 0 alone decides when a rank stops (Shutdown, or its pipe closing): a
    # Ctrl-C or SIGTERM sent to the whole process group must let the worker drain first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s tp-rank-{spec.tp_rank} "
                               "%(name)s: %(message)s")
    try:
        import torch

        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        init_distributed(spec)
        runner = build_runner(spec, with_tokenizer=False)
        conn.send(RankReady(spec.tp_rank, os.getpid(), runner.num_blocks,
                            runner.bytes_per_block))
        _serve(runner, conn)
    except EOFError:
        logger.warning("rank 0 is gone; TP rank %d exits", spec.tp_rank)
    except BaseException as exc:
        logger.exception("TP rank %d failed", spec.tp_rank)
        try:
            conn.send(RankFailed(spec.tp_rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        _destroy_process_group()


def _serve(runner: Any, conn: Connection) -> None:
    decoder = StepDecoder()
    while True:
        message = conn.recv()
        if isinstance(message, RunStep):
            # NOTE: a delta that does not apply raises StepDeltaError before the forward:
            # the rank fails (RankFailed, exit) rather than run a guessed block table
            runner.execute_shard(decoder.decode(message.delta, message.blocks_to_load))
        elif isinstance(message, ReadBlocks):
            conn.send(BlocksRead(runner.read_blocks(message.block_ids)))
        elif isinstance(message, WriteBlocks):
            runner.write_blocks(message.items)
        elif isinstance(message, Shutdown):
            return
        else:
            raise TypeError(f"unexpected message {type(message).__name__} from rank 0")


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
