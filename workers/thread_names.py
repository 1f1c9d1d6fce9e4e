"""A worker thread's OS name (Linux): its Python name, so `top -H`, `ps -L`, profilers
and /proc/<pid>/task/*/comm show which thread spends the CPU (the batcher, the writer,
the publisher...). `benchmarks/bench_batch.py` reads the batcher's CPU time this way."""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

_PR_SET_NAME = 15  # prctl option; the kernel keeps 15 bytes of the name
MAX_NAME_BYTES = 15


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def name_this_thread() -> None:
    """Give the calling thread's Python name (its first 15 bytes) to the OS thread.
    Does nothing where the OS has no such call."""
    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is None:
        return
    name = threading.current_thread().name.encode()[:MAX_NAME_BYTES]
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
