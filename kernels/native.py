"""Our own CPU kernel for the projections of few rows (`native/skinny.c`), built for this
CPU at first use and called through ctypes.

Why: a decode step multiplies a handful of rows by every weight, so it is bound by how
fast the weights stream from memory. Read in their checkpoint layout, one row after
another, they stream at close to the core's read bandwidth; torch's `linear` and oneDNN's
prepacked path reach half to two thirds of it on some CPUs (Zen 4: bf16 at one row 8.8
against 12.6 ms per pass over 189 MB; docs/benchmarks.md "CPU speed").

The library is compiled with the C compiler (`CC`, else `cc`) and `-march=native` into
`LLMQ_KERNEL_CACHE` (default `~/.cache/llmq/kernels`), under a name hashed from the
source, the flags and this CPU's model and flags, so a cache shared by other CPUs never
hands out a build for the wrong ISA. Without a compiler `available()` is False and the
callers keep torch's paths; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.cpu import cpu_description_key

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "skinny.c"
CACHE_ENV = "LLMQ_KERNEL_CACHE"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
DTYPES = (torch.float32, torch.bfloat16)
# seconds a build may take before it is given up (it takes about half a second)
BUILD_TIMEOUT = 120


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "llmq" / "kernels"


def _build(source: Path, target: Path) -> None:
    """Compile `source` into `target`, atomically: a process that builds the same library
    at the same moment (two workers starting) finds either none or a whole one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *CFLAGS, "-o", partial, str(source)],
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if result.returncode:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


class _Library:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))  # torch is loaded: its OpenMP runtime is reused
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for fn in (lib.llmq_skinny_f32, lib.llmq_skinny_bf16):
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
            fn.restype = None
        lib.llmq_skinny_isa.restype = ctypes.c_char_p
        self.by_dtype = {torch.float32: lib.llmq_skinny_f32,
                         torch.bfloat16: lib.llmq_skinny_bf16}
        self.isa = lib.llmq_skinny_isa().decode()
        self.path = path


@functools.cache
def _library() -> _Library | None:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(CFLAGS).encode()
                         + cpu_description_key().encode()).hexdigest()[:16]
    target = cache_dir() / f"skinny-{key}.so"
    try:
        if not target.exists():
            _build(SOURCE, target)
        library = _Library(target)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("native CPU kernel unavailable (%s); torch's linear paths only", exc)
        return None
    logger.info("native CPU kernel: %s (%s)", target, library.isa)
    return library


def available() -> bool:
    """True when the kernel is built (or builds now) and loads on this machine."""
    return _library() is not None


def isa() -> str:
    """Which of the kernel's code paths this CPU's build took ("avx512_bf16", "avx512f",
    "generic"), or "" when it is unavailable."""
    library = _library()
    return library.isa if library else ""


def supports(weight: torch.Tensor) -> bool:
    """True when `skinny_linear` can take `weight` [out, in]."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and not weight.is_mkldnn and weight.is_contiguous() and available())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight^T + bias` for x [M, in] of few rows (cost grows with M: each row is
    another pass of multiply-adds over the weight, read once from memory). `weight` must
    pass `supports`; x and bias are of its dtype."""
    library = _library()
    if library is None:
        raise RuntimeError("the native CPU kernel is unavailable")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"x {x.dtype}, weight {weight.dtype} and bias must share a dtype")
    rows, features = x.shape
    if features != weight.shape[1]:
        raise ValueError(f"x has {features} features, the weight takes {weight.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
    library.by_dtype[x.dtype](x.data_ptr(), weight.data_ptr(),
                              None if bias is None else bias.data_ptr(), out.data_ptr(),
                              rows, weight.shape[0], features, x.stride(0),
                              torch.get_num_threads())
    return out
