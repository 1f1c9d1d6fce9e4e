"""`TensorParallelRunner`: the engine's runner for a device group of `tp` devices.

Rank 0 lives in the calling process (the group's worker) and owns a `ModelRunner` over
its shard; ranks 1..tp-1 are SPAWNED processes (never forked: accelerators and fork do not
mix), one per extra device, each loading only its shard. Every step, rank 0 sends the
`SchedulerOutput` as a delta against what the ranks already hold (`StepEncoder`,
parallel/step_delta.py: new sequences whole, running ones as their new tokens and
blocks; pickled over one pipe per rank), then all ranks run the same forward; the
layers' collectives (all-reduce after row-parallel matmuls, all-gather of the logits)
keep them in lockstep, and rank 0 samples.

Failure: a watchdog thread waits on the rank processes' sentinels. A rank that exits
marks the group failed: the step in flight raises `TensorParallelError` (its collective
fails as the dead peer's sockets close, or after `timeout_seconds`), every later step
raises at once, and `on_failure` callbacks run (the worker stops consuming and exits).
A group is never repaired in place: its jobs are failed or requeued and another group
(or the restarted worker) serves them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any, cast

from workers.engine.parallel.launch import (
    TensorParallelError,
    free_port,
    join_process_group,
    recv,
    spawn_ranks,
    wait_ready,
)
from workers.engine.parallel.messages import (
    BlocksRead,
    RankSpec,
    ReadBlocks,
    RunStep,
    Shutdown,
    WriteBlocks,
)
from workers.engine.parallel.rank import build_runner
from workers.engine.parallel.step_delta import StepEncoder
from workers.engine.step_io import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class TensorParallelRunner:
    """Same protocol as `ModelRunner` (`num_blocks`, `block_size`, `execute`,
    `read_blocks`, `write_blocks`), over `len(devices)` ranks."""

    def __init__(
        self,
        model_dir: str,
        devices: list[str],
        *,
        dtype: str = "auto",
        dist_backend: str = "gloo",
        block_size: int = 16,
        kv_cache_bytes: int = 256 << 20,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        timeout_seconds: float = 120.0,
    ) -> None:
        if len(devices) < 2:
            raise ValueError("a tensor-parallel group needs >= 2 devices; use ModelRunner")
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            raise TensorParallelError(
                "this process already drives a tensor-parallel group (one per process): "
                "close() the other engine or LLM first"
            )
        self.tp_size = len(devices)
        self.devices = list(devices)
        self.timeout_seconds = timeout_seconds
        self._on_failure: list[Callable[[str], None]] = []
        self._failure: str | None = None
        # held while the failure callbacks run: a step raises only after they have run
        self._fail_lock = threading.RLock()
        self._failing = False
        self._closing = False
        self._lock = threading.Lock()  # one pipe conversation at a time, in rank order
        self._encoder = StepEncoder()  # what every rank holds of the running sequences
        init_method = f"tcp://127.0.0.1:{free_port()}"
        # CPU ranks share the host's cores: split the intra-op threads between them
        threads = max(1, torch.get_num_threads() // self.tp_size) if devices[0] == "cpu" \
            else None
        specs = [RankSpec(model_dir=str(model_dir), dtype=dtype, device=devices[rank],
                          tp_size=self.tp_size, tp_rank=rank, dist_backend=dist_backend,
                          init_method=init_method, block_size=block_size,
                          kv_cache_bytes=kv_cache_bytes,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_num_seqs=max_num_seqs, timeout_seconds=timeout_seconds,
                          log_level=logging.getLogger().getEffectiveLevel(),
                          num_threads=threads)
                 for rank in range(self.tp_size)]
        self._procs, self._conns = spawn_ranks(specs[1:])
        started = time.monotonic()
        try:
            join_process_group(specs[0], self._procs)
            self._local = build_runner(specs[0], with_tokenizer=True)
            wait_ready(self._procs, self._conns, self._local.num_blocks, timeout_seconds)
        except BaseException:
            self.shutdown()
            raise
        self.loaded = self._local.loaded  # rank 0's checkpoint: tokenizer, eos ids, config
        self._wake_r, self._wake_w = mp.get_context("spawn").Pipe(duplex=False)
        self._watchdog = threading.Thread(target=self._watch, name="llmq-tp-watchdog",
                                          daemon=True)
        self._watchdog.start()
        logger.info("tensor parallel group of %d ranks on %s (%s) ready in %.1fs; rank pids %s",
                    self.tp_size, ",".join(self.devices), dist_backend,
                    time.monotonic() - started, self.rank_pids)

    # -- the runner protocol -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._local.num_blocks

    @property
    def block_size(self) -> int:
        return self._local.block_size

    @property
    def vocab_size(self) -> int:
        return self._local.vocab_size

    @property
    def dtype(self) -> Any:
        return self._local.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of a block over the whole group: the ranks' slabs, concatenated."""
        return self._local.bytes_per_block * self.tp_size

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[tp_size, 2, num_layers, block_size, num_kv_heads // tp_size, head_dim]"""
        return (self.tp_size, *self._local.kv_cache.shape[1:])

    @property
    def rank_pids(self) -> list[int]:
        """Process id of each rank; rank 0 is this process."""
        # (a process has its pid once started: spawn_ranks starts them)
        return [os.getpid(), *(cast(int, proc.pid) for proc in self._procs)]

    @property
    def failure(self) -> str | None:
        """Why the group failed, or None while it is healthy."""
        return self._failure

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` (from the watchdog thread) when the group fails."""
        with self._fail_lock:
            self._on_failure.append(callback)
            failure = self._failure
        if failure is not None:
            callback(failure)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step on every rank; rank 0 samples. Raises TensorParallelError when a
        rank is lost (this step and every later one)."""
        with self._lock:
            self._raise_if_failed()
            per_rank = self._split_loads(out.blocks_to_load)
            try:
                # NOTE: the other ranks never sample: the delta carries no token histories,
                # only what their forward reads
                delta = self._encoder.encode(out)
                for rank, conn in enumerate(self._conns, start=1):
                    conn.send(RunStep(delta, per_rank[rank]))
                return self._local.execute(replace(out, blocks_to_load=per_rank[0]))
            except Exception as exc:
                # NOTE: some ranks may hold this step and others not; today the group
                # fails below and never runs another step, but should that change, the
                # next delta resets every rank's cache and sends each sequence whole
                self._encoder.reset()
                raise self._step_error("a step", exc) from exc

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's group blob: rank 0's slab, then rank 1's, ... (all layers each)."""
        if not block_ids:
            return []
        with self._lock:
            self._raise_if_failed()
            try:
                for conn in self._conns:
                    conn.send(ReadBlocks(list(block_ids)))
                parts = [self._local.read_blocks(block_ids)]
                for conn in self._conns:
                    parts.append(recv(conn, BlocksRead, self.timeout_seconds).blobs)
            except Exception as exc:
                raise self._step_error("reading KV blocks", exc) from exc
        return [b"".join(slabs) for slabs in zip(*parts)]

    def write_blocks(self, items: list[tuple[int, bytes]]) -> None:
        """Fill blocks from group blobs that `read_blocks` produced."""
        if not items:
            return
        with self._lock:
            self._raise_if_failed()
            per_rank = self._split_loads(items)
            try:
                for rank, conn in enumerate(self._conns, start=1):
                    conn.send(WriteBlocks(per_rank[rank]))
                self._local.write_blocks(per_rank[0])
            except Exception as exc:
                raise self._step_error("writing KV blocks", exc) from exc

    # -- lifecycle -------------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every rank process and leave the process group (idempotent)."""
        import torch.distributed as dist

        self._closing = True
        for conn in self._conns:
            try:
                conn.send(Shutdown())
            except OSError:
                pass  # that rank is already gone
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("TP rank process %s did not stop; killing it", proc.pid)
                proc.kill()
                proc.join(5.0)
        wake = getattr(self, "_wake_w", None)
        if wake is not None:
            wake.close()  # ends the watchdog
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group whose peer died may not tear down cleanly
                logger.warning("leaving the TP process group failed", exc_info=True)

    close = shutdown

    # -- internals ---------------------------------------------------------------------------

    def _split_loads(self, items: list[tuple[int, bytes]]) -> list[list[tuple[int, bytes]]]:
        """Cut each group blob into the ranks' slabs."""
        per_rank: list[list[tuple[int, bytes]]] = [[] for _ in range(self.tp_size)]
        if not items:
            return per_rank
        size = self._local.bytes_per_block
        for block_id, blob in items:
            if len(blob) != size * self.tp_size:
                raise ValueError(
                    f"KV blob for block {block_id} has {len(blob)} bytes, expected "
                    f"{size * self.tp_size} ({self.tp_size} ranks x {size}): it was written "
                    f"for another model, dtype, block size or TP layout"
                )
            for rank in range(self.tp_size):
                per_rank[rank].append((block_id, blob[rank * size:(rank + 1) * size]))
        return per_rank

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def _step_error(self, what: str, exc: BaseException) -> TensorParallelError:
        """The group is unusable after any error mid-conversation: say why, fail it."""
        # a dead peer surfaces first as a collective or pipe error; give the watchdog a
        # moment to name the rank that died
        deadline = time.monotonic() + 2.0
        while self._failure is None and time.monotonic() < deadline:
            if any(not proc.is_alive() for proc in self._procs):
                self._note_dead_ranks()
                break
            time.sleep(0.05)
        if self._failure is None:
            self._fail(f"tensor-parallel group failed {what}: {type(exc).__name__}: {exc}")
        return TensorParallelError(self._failure)

    def _note_dead_ranks(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) died (exit code "
                           f"{proc.exitcode}); the device group stops")
                return

    def _fail(self, reason: str) -> None:
        """Run the failure callbacks, then make the failure visible: whoever sees it (a
        step that raises) knows the callbacks have run. A second failure is ignored."""
        with self._fail_lock:
            if self._failure is not None or self._failing:
                return
            self._failing = True
            logger.error("%s", reason)
            for callback in list(self._on_failure):
                try:
                    callback(reason)
                except Exception:
                    logger.exception("a TP failure callback failed")
            self._failure = reason

    def _watch(self) -> None:
        sentinels = [proc.sentinel for proc in self._procs]
        while True:
            ready = wait([*sentinels, self._wake_r])
            if self._closing or self._wake_r in ready:
                return
            self._note_dead_ranks()
            return
