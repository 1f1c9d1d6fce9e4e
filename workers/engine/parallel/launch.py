"""Starting a TP group: spawn the rank processes, join the process group, wait until every
rank has loaded its shard. Each wait watches the rank processes, so a rank that dies
while starting fails the start at once instead of after a rendezvous timeout."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from workers.engine.errors import DeviceGroupError
from workers.engine.parallel.messages import RankFailed, RankReady, RankSpec
from workers.engine.parallel.rank import init_distributed, rank_main


class TensorParallelError(DeviceGroupError):
    """The TP group lost a rank (or a rank failed a step); it cannot run another step."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(specs: list[RankSpec]) -> tuple[list[BaseProcess], list[Connection]]:
    """One SPAWNED process per spec (never forked: accelerator runtimes do not survive a
    fork), each with its own pipe; returns the processes and rank 0's pipe ends."""
    context = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    for spec in specs:
        parent_end, child_end = context.Pipe()
        proc = context.Process(target=rank_main, args=(spec, child_end),
                               name=f"llmq-tp-rank-{spec.tp_rank}", daemon=True)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    return procs, conns


def join_process_group(spec: RankSpec, procs: list[BaseProcess]) -> None:
    """`init_distributed` for rank 0, failing fast when a rank dies before joining."""
    errors: list[BaseException] = []

    def join() -> None:
        try:
            init_distributed(spec)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(exc)

    thread = threading.Thread(target=join, name="llmq-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        for rank, proc in enumerate(procs, start=1):
            if not proc.is_alive():
                raise TensorParallelError(
                    f"TP rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} "
                    f"before joining the group; see its log")
    if errors:
        raise errors[0]


def wait_ready(procs: list[BaseProcess], conns: list[Connection], local_num_blocks: int,
               timeout: float) -> None:
    """Wait for every rank's `RankReady`; all ranks must hold the same number of blocks."""
    num_blocks = {0: local_num_blocks}
    for rank, (proc, conn) in enumerate(zip(procs, conns), start=1):
        ready = wait([conn, proc.sentinel], timeout=timeout)
        if not ready:
            raise TensorParallelError(f"TP rank {rank} did not load its shard within "
                                      f"{timeout:.0f}s")
        if conn not in ready and not conn.poll():
            raise TensorParallelError(f"TP rank {rank} (pid {proc.pid}) exited with code "
                                      f"{proc.exitcode} while loading; see its log")
        num_blocks[rank] = recv(conn, RankReady, timeout).num_blocks
    if len(set(num_blocks.values())) != 1:
        raise TensorParallelError(f"TP ranks disagree on the KV cache size: {num_blocks}")


def recv(conn: Connection, expected: type, timeout: float) -> Any:
    """The rank's next message, which must be an `expected`; a `RankFailed` raises."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer from a TP rank in {timeout:.0f}s")
    message = conn.recv()
    if isinstance(message, RankFailed):
        raise TensorParallelError(f"TP rank {message.tp_rank} failed: {message.reason}")
    if not isinstance(message, expected):
        raise TypeError(f"expected {expected.__name__}, got {type(message).__name__}")
    return message
