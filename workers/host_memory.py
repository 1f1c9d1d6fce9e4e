"""Host (CPU) memory settings of a device-group worker process: the allocator and the
garbage collector.

A model step allocates and frees tensors of a few MB each (a layer's gathered keys and
values, the MLP activations). glibc serves such sizes with mmap, or gives the freed top of
a thread's heap back to the kernel, and either way every step faults the same pages in
again: in the worker (the step runs on the batcher thread, beside a dozen other threads)
that was ~7,000 page faults and a third of the step's CPU time. Raising the mmap and trim
thresholds keeps freed memory in the process for the next step.

Python's garbage collector: `freeze_startup_objects` moves what loading made out of its
sight once the group is ready (`tasks/gc_freeze.py` says why).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from tasks.gc_freeze import freeze_loaded_objects

logger = logging.getLogger(__name__)

# mallopt(3) parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's ceiling for the mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): larger
# requests are refused, and allocations above it keep using mmap
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# freed heap tops smaller than this stay with the process
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Tune glibc malloc so a step's temporaries reuse memory; False where not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: nothing to tune
        logger.debug("no mallopt in the C library; allocator left as is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not ok:
        logger.warning("mallopt refused the worker's allocator thresholds; steps may "
                       "spend time in page faults")
    return ok


def freeze_startup_objects() -> int:
    """`tasks.gc_freeze.freeze_loaded_objects` once the group is loaded: full collections
    during serving no longer walk the model's, the tokenizer's and the libraries' objects.
    Returns how many were frozen."""
    frozen = freeze_loaded_objects()
    logger.info("%d objects made at start-up frozen out of garbage collection", frozen)
    return frozen
