"""The batcher thread's scheduling priority (its nice value; Linux keeps one per thread).

On a host that runs the rest of the stack too (the web, Postgres, Redis), every
submission, claim and event those processes handle can take the batcher's core for a
moment, and a step that waits for its core holds up every job in it. With
`LLMQ_BATCHER_NICE` below 0 the batcher thread, and the threads the engine's thread pool
starts from it, run ahead of the host's default-priority threads: the rest of the stack
runs on the cores the engine leaves.

A raised priority is only taken where the engine leaves cores: where its threads are
fewer than the cores this process may run on. An engine whose threads fill every core
would otherwise starve the web and the database of the host under load, so it keeps the
default priority. Lowering the nice value needs CAP_SYS_NICE or an RLIMIT_NICE that allows
it (a container's `--ulimit nice=40`); where the system refuses, the batcher runs at its
default priority and says so once.

Linux orders threads by nice within one scheduling group: with autogroups (a session's
processes share one) or cgroups (systemd services, containers), the value ranks the
batcher against the worker's own threads and the processes of its session or cgroup (all
of `llmq up`'s); processes in other groups share the cores by their groups' weights.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

NICE_MIN, NICE_MAX = -20, 19  # the range Linux takes


def batcher_nice(requested: int, engine_threads: int, cores: int) -> tuple[int, str]:
    """The nice value the batcher thread takes, and why (for the log).

    `requested`: the setting; `engine_threads`: the engine's intra-op threads; `cores`:
    the cores this process may run on.
    """
    if not NICE_MIN <= requested <= NICE_MAX:
        raise ValueError(f"a nice value is between {NICE_MIN} and {NICE_MAX}, got {requested}")
    if requested >= 0:
        return requested, "as set"
    if engine_threads >= cores:
        return 0, (f"the engine's {engine_threads} threads take every one of the {cores} "
                   "cores: a raised priority would starve the rest of the host")
    return requested, (f"the engine's {engine_threads} threads leave "
                       f"{cores - engine_threads} of {cores} cores to the rest of the host")


def set_this_thread_nice(nice: int) -> bool:
    """Give the calling thread the nice value `nice` (threads it starts afterwards inherit
    it). False, with one log line, where the system refuses or has no per-thread nice."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        logger.info("the batcher keeps its default priority: nice %d was refused (%s; it "
                    "needs CAP_SYS_NICE or an RLIMIT_NICE that allows it)", nice, exc)
        return False
    return True


def this_thread_nice() -> int:
    """The calling thread's nice value."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
