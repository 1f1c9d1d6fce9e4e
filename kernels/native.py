"""Our own CPU kernels, built for this CPU at first use and called through ctypes: the
projections of few rows (`native/skinny.c`) and the small operations of a step
(`native/step_ops.c`: RMSNorm, rotary, the gated activation, the KV store, decode
attention), which `register()` puts in `kernels.dispatch` for the CPU; and
`NativeDecoder` (`native/decoder.c`), which runs every decoder layer of a decode step of
few rows as one call over those same kernels.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from kernels.cpu import cpu_description_key
from kernels.timing import alternated_medians

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("native") / name
                for name in ("skinny.c", "panels.c", "step_ops.c", "decoder.c"))
HEADERS = tuple(Path(__file__).with_name("native") / name
                for name in ("bf16.h", "avx2.h", "ops.h"))
CACHE_ENV = "LLMQ_KERNEL_CACHE"
# -ffp-contract=off: `a * b - c * d` stays two roundings, as torch's elementwise ops
CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off")
DTYPES = (torch.float32, torch.bfloat16)
# seconds a build may take before it is given up (it takes about half a second)
BUILD_TIMEOUT = 120


def home_cache_dir(name: str) -> Path | None:
    """`~/.cache/llmq/<name>`: where a process keeps what it built or measured for the
    next start on this machine (the native kernel here, the engine's start-up timings;
    docker-compose keeps the worker's `~/.cache/llmq` in a volume). None for a user
    without a home directory (an unnamed uid in a container)."""
    try:
        return Path.home() / ".cache" / "llmq" / name
    except RuntimeError:
        return None


def cache_dir() -> Path | None:
    """Where the kernel is built (`LLMQ_KERNEL_CACHE`), None where there is no such place."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return home_cache_dir("kernels")


def _build(sources: tuple[Path, ...], target: Path, march: str) -> None:
    """Compile `sources` into `target`, atomically: a process that builds the same library
    at the same moment (two workers starting) finds either none or a whole one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CC", "cc")
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        result = subprocess.run([compiler, *CFLAGS, f"-march={march}", "-o", partial,
                                 *map(str, sources), "-lm"],
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
        lib.llmq_skinny_set_row_prefetch.argtypes = [i64]
        lib.llmq_skinny_set_row_prefetch.restype = None
        lib.llmq_skinny_set_row_streams.argtypes = [i64]
        lib.llmq_skinny_set_row_streams.restype = None
        self.set_row_streams = lib.llmq_skinny_set_row_streams
        self.set_row_prefetch = lib.llmq_skinny_set_row_prefetch
        self.by_dtype = {torch.float32: lib.llmq_skinny_f32,
                         torch.bfloat16: lib.llmq_skinny_bf16}
        lib.llmq_panel_width.restype = i64
        self.panel_width = lib.llmq_panel_width()
        lib.llmq_pack_panels_f32.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
        lib.llmq_pack_panels_f32.restype = None
        self.pack_panels = lib.llmq_pack_panels_f32
        lib.llmq_panels_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
        lib.llmq_panels_f32.restype = ctypes.c_int
        self.panels_f32 = lib.llmq_panels_f32
        lib.llmq_panels_set_row_prefetch.argtypes = [i64]
        lib.llmq_panels_set_row_prefetch.restype = None
        self.set_panel_row_prefetch = lib.llmq_panels_set_row_prefetch
        lib.llmq_panels_set_row_streams.argtypes = [i64]
        lib.llmq_panels_set_row_streams.restype = None
        self.set_panel_row_streams = lib.llmq_panels_set_row_streams
        flt = ctypes.c_float
        signatures = {
            "rms_norm": [ptr, i64, i64, i64, i64, i64, ptr, flt, ptr, ctypes.c_int],
            "add_rms_norm": [ptr, ptr, i64, i64, ptr, flt, ptr, ptr, ctypes.c_int],
            "rotary": [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int],
            "silu_and_mul": [ptr, i64, i64, ptr, ctypes.c_int],
            "store_kv": [ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, ptr, ptr],
            "decode_attention": [ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, ptr,
                                 ptr, ptr, flt, ptr, ctypes.c_int],
        }
        # op name -> dtype -> function (ctypes function pointers: typeshed does not export
        # their class, so they are typed as the callables they are)
        self.ops: dict[str, dict[torch.dtype, Callable[..., Any]]] = {}
        for op, argtypes in signatures.items():
            self.ops[op] = {}
            for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
                fn = getattr(lib, f"llmq_{op}_{suffix}")
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int if op == "decode_attention" else None
                self.ops[op][dtype] = fn
        self.decode_layers = {}
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"llmq_decode_layers_{suffix}")
            fn.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int, ptr, ptr, i64, ptr, ptr,
                           ptr, ptr, ptr, ptr, ptr, i64, ctypes.c_int]
            fn.restype = ctypes.c_int
            self.decode_layers[dtype] = fn
        lib.llmq_decode_scratch.argtypes = [ptr, i64]
        lib.llmq_decode_scratch.restype = i64
        self.decode_scratch = lib.llmq_decode_scratch
        self.isa = lib.llmq_skinny_isa().decode()
        self.path = path


@functools.cache
def build(march: str = "native") -> _Library | None:
    """The library built for `march` (`native`: this CPU; the tests also build a baseline
    such as `x86-64-v3`, whose plain loops this CPU would otherwise never run), or None
    when it cannot be built or loaded (the reason is logged)."""
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join((*CFLAGS, march)).encode()
                         + cpu_description_key().encode()).hexdigest()[:16]
    directory = cache_dir()
    if directory is None:  # no home directory (an unnamed uid): nowhere safe to build
        logger.warning("native CPU kernel unavailable: no home directory to build it in; "
                       "set %s; torch's linear paths only", CACHE_ENV)
        return None
    target = directory / f"llmq-cpu-{march}-{key}.so"
    try:
        if not target.exists():
            _build(SOURCES, target, march)
        library = _Library(target)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("native CPU kernel unavailable (%s); torch's linear paths only", exc)
        return None
    logger.info("native CPU kernel: %s (%s)", target, library.isa)
    return library


def _library() -> _Library | None:
    return build("native")


def _loaded() -> _Library:
    """The library, or RuntimeError where it cannot be built here (callers that may run
    without it ask `available()` first)."""
    library = _library()
    if library is None:
        raise RuntimeError("the native CPU kernel is unavailable")
    return library


def available() -> bool:
    """True when the kernel is built (or builds now) and loads on this machine."""
    return _library() is not None


def isa() -> str:
    """Which of the kernel's code paths this CPU's build took ("amx_bf16", "avx512_bf16",
    "avx512f", "avx2", "generic"), or "" when it is unavailable."""
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
    library = _loaded()
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"x {x.dtype}, weight {weight.dtype} and bias must share a dtype")
    features = x.shape[1]
    if features != weight.shape[1]:
        raise ValueError(f"x has {features} features, the weight takes {weight.shape[1]}")
    return _multiply(library.by_dtype[x.dtype], x, weight, bias, weight.shape[0])


def _multiply(kernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              out_features: int) -> torch.Tensor:
    """`kernel(x, weight, bias, out, M, N, K, ldx, threads)` on checked operands: x rows
    made unit-stride, bias contiguous; returns out [M, N]. A kernel returning nonzero
    could not allocate its scratch (MemoryError)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    rows, features = x.shape
    out = torch.empty(rows, out_features, dtype=x.dtype)
    if kernel(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
              out.data_ptr(), rows, out_features, features, x.stride(0),
              torch.get_num_threads()):
        raise MemoryError("the native kernel could not allocate its scratch")
    return out


# ---- fp32 weights packed in panels (native/panels.c) ------------------------------------
#
# From a few rows of x on, the row-major kernel above runs out of multiply-adds before the
# memory runs out of bytes (fp32, 100m model, 2 threads, Xeon with AVX-512: 16 rows 42-47
# ms a pass, the bytes alone 19-22); the panels keep every multiply-add busy and still read
# each weight byte once a call (16 rows 25 ms, 64 rows 64 against 133; docs/benchmarks.md).
# They serve one row as fast as the row-major kernel, so an fp32 weight the native kernel
# takes is packed once and serves all its calls; the row-major copy is freed where a
# prepacked copy takes the calls above them (ModelRunner._apply_linear_plan).

# the builds whose panels are vector code (elsewhere the plain loops: correct, not fast)
PANEL_ISAS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def panels_supported(weight: torch.Tensor) -> bool:
    """True when `weight` [out, in] can be packed for `panel_linear` and it pays here: a
    contiguous fp32 CPU tensor, on a build whose panel code is vector code."""
    return weight.dtype == torch.float32 and supports(weight) and isa() in PANEL_ISAS


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] (`panels_supported`) packed for `panel_linear`: [ceil(out /
    width), in, width] with wp[p, k, j] = weight[p * width + j, k] (zeros past `out`)."""
    library = _loaded()
    out_features, in_features = weight.shape
    width = library.panel_width
    packed = torch.empty(-(-out_features // width), in_features, width, dtype=torch.float32)
    library.pack_panels(weight.data_ptr(), packed.data_ptr(), out_features, in_features,
                        torch.get_num_threads())
    return packed


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of the weight `panels` = `pack_panels(weight)` holds:
    weight[ids], [*ids.shape, in], the same values read from the panels' strided layout
    (a lookup where the panels are the only copy left)."""
    width = panels.shape[2]
    flat = ids.reshape(-1)
    rows = panels[torch.div(flat, width, rounding_mode="floor"), :, flat % width]
    return rows.reshape(*ids.shape, panels.shape[1])


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight^T + bias` for fp32 x [M, in], with `panels` = `pack_panels(weight)` and
    `out_features` its rows."""
    library = _loaded()
    rows, features = x.shape
    if x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        raise TypeError(f"panels take fp32 x and bias, not {x.dtype}")
    if features != panels.shape[1] or panels.shape[0] * panels.shape[2] < out_features:
        raise ValueError(f"x has {features} features; the panels take {panels.shape[1]} "
                         f"and give {out_features}")
    return _multiply(library.panels_f32, x, panels, bias, out_features)


# How far ahead (bytes) the one-row bodies of the AVX-512 builds may prefetch the weight
# stream, first the build's default: the start-up timing (`time_row_prefetch`) keeps the
# fastest. AVX2 builds keep their own fixed distances (measured on Zen 3), so there is
# nothing to choose.
ROW_PREFETCH_CHOICES = (16384, 2048, 0)


def row_prefetch_tunable() -> bool:
    """True when this CPU's build takes `set_row_prefetch` (its AVX-512 paths)."""
    return isa() in ("amx_bf16", "avx512_bf16", "avx512f")


def set_row_prefetch(num_bytes: int) -> None:
    """How far ahead the one-row bodies prefetch, for every later call in this process."""
    library = _loaded()
    if num_bytes < 0:
        raise ValueError(f"a prefetch distance is >= 0 bytes, not {num_bytes}")
    library.set_row_prefetch(num_bytes)


def time_row_prefetch(weights: list[torch.Tensor], choices: tuple[int, ...] = ROW_PREFETCH_CHOICES,
                      rounds: int = 11) -> dict[int, float]:
    """Per prefetch distance, the median seconds of a one-row pass over `weights` on the
    native kernel (the choices alternated, `timing.alternated_medians`). Leaves the
    distance at the first choice; the caller sets the one it keeps."""
    return _time_choices(_one_row_pass(weights), choices, rounds, set_row_prefetch)


def _one_row_pass(weights: list[torch.Tensor]) -> Callable[[], None]:
    """A one-row `skinny_linear` over each of `weights`."""
    xs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights]

    def one_row_pass() -> None:
        for x, w in zip(xs, weights):
            skinny_linear(x, w)

    return one_row_pass


# How many bf16 weight rows a one-row call reads side by side on the AVX2 builds (bf16
# widened as it streams; skinny.c `streams_bf16f`), first the build's default (one): the
# start-up timing (`time_row_streams`) keeps the fastest. Other builds read one.
MAX_ROW_STREAMS = 3
ROW_STREAMS_CHOICES = (1, 2, 3)


def row_streams_tunable() -> bool:
    """True when this CPU's build takes `set_row_streams` (its AVX2 bf16 one-row body)."""
    return isa() == "avx2"


def set_row_streams(streams: int) -> None:
    """How many bf16 weight rows one-row calls read at once (1..MAX_ROW_STREAMS), for
    every later call in this process (a build other than AVX2 ignores it)."""
    library = _loaded()
    if not 1 <= streams <= MAX_ROW_STREAMS:
        raise ValueError(f"one-row calls read 1 to {MAX_ROW_STREAMS} weight rows at once, "
                         f"not {streams}")
    library.set_row_streams(streams)


def time_row_streams(weights: list[torch.Tensor], choices: tuple[int, ...] = ROW_STREAMS_CHOICES,
                     rounds: int = 11) -> dict[int, float]:
    """Per number of weight rows read side by side, the median seconds of a one-row pass
    over the bf16 `weights` (as for `time_row_prefetch`). Leaves the first choice set;
    the caller sets the one it keeps."""
    return _time_choices(_one_row_pass(weights), choices, rounds, set_row_streams)


def _time_choices(one_row_pass: Callable[[], None], choices: tuple[int, ...], rounds: int,
                  set_choice: Callable[[int], None]) -> dict[int, float]:
    """Per choice (set with `set_choice`, untimed), the median seconds of `one_row_pass`,
    the choices alternated (`timing.alternated_medians`); leaves the first choice set."""
    with torch.inference_mode():
        times = alternated_medians({choice: one_row_pass for choice in choices}, rounds,
                                   prepare=set_choice)
    set_choice(choices[0])
    return times


# How a one-row call on fp32 panels prefetches (`panel_linear`), first the build's default:
# NEXT_PANEL (the panel after the one it reads, as calls of more rows do), then bytes
# ahead of its own stream (0: no software prefetch). The start-up timing
# (`time_panel_row_prefetch`) keeps the fastest.
NEXT_PANEL = -1
PANEL_ROW_PREFETCH_CHOICES = (NEXT_PANEL, 2048, 0)


def set_panel_row_prefetch(num_bytes: int) -> None:
    """How one-row calls on panels prefetch (`PANEL_ROW_PREFETCH_CHOICES`), for every
    later call in this process."""
    library = _loaded()
    if num_bytes < NEXT_PANEL:
        raise ValueError(f"a panel prefetch is NEXT_PANEL or >= 0 bytes, not {num_bytes}")
    library.set_panel_row_prefetch(num_bytes)


def time_panel_row_prefetch(panels: list[tuple[torch.Tensor, int]],
                            choices: tuple[int, ...] = PANEL_ROW_PREFETCH_CHOICES,
                            rounds: int = 11) -> dict[int, float]:
    """Per choice, the median seconds of a one-row pass over `panels` ((`pack_panels`
    result, out_features) pairs) with `panel_linear` (the choices alternated,
    `timing.alternated_medians`). Leaves the first choice set; the caller sets the one it
    keeps."""
    return _time_choices(_panel_one_row_pass(panels), choices, rounds, set_panel_row_prefetch)


def _panel_one_row_pass(panels: list[tuple[torch.Tensor, int]]) -> Callable[[], None]:
    """A one-row `panel_linear` over each of `panels` ((packed, out_features) pairs)."""
    xs = [torch.randn(1, packed.shape[1]) for packed, _ in panels]

    def one_row_pass() -> None:
        for x, (packed, out_features) in zip(xs, panels):
            panel_linear(x, packed, out_features)

    return one_row_pass


# How many panels a call of up to PANEL_STREAM_ROWS rows on fp32 panels reads side by
# side (fewer where its rows' sums do not fit in the registers), first the build's default
# (one): the start-up timing (`time_panel_row_streams`, on one-row calls) keeps the
# fastest. Xeon Ice Lake, 2 threads, a pass over the 100m model: one row 17.6-18.9 ms on
# 4-8 streams against 20.8-22.6 on one; 2-4 rows 18.0-20.6 against 22.3-24.2 (panels.c).
MAX_PANEL_ROW_STREAMS = 8
PANEL_STREAM_ROWS = 4
PANEL_ROW_STREAMS_CHOICES = (1, 4, 8)


def set_panel_row_streams(streams: int) -> None:
    """How many panels calls of up to PANEL_STREAM_ROWS rows read at once
    (1..MAX_PANEL_ROW_STREAMS), for every later call in this process."""
    library = _loaded()
    if not 1 <= streams <= MAX_PANEL_ROW_STREAMS:
        raise ValueError(f"calls of few rows read 1 to {MAX_PANEL_ROW_STREAMS} panels at "
                         f"once, not {streams}")
    library.set_panel_row_streams(streams)


def time_panel_row_streams(panels: list[tuple[torch.Tensor, int]],
                           choices: tuple[int, ...] = PANEL_ROW_STREAMS_CHOICES,
                           rounds: int = 11) -> dict[int, float]:
    """Per number of streams, the median seconds of a one-row pass over `panels` (as for
    `time_panel_row_prefetch`, with the prefetch as it is set). Leaves the first choice
    set; the caller sets the one it keeps."""
    return _time_choices(_panel_one_row_pass(panels), choices, rounds, set_panel_row_streams)


# ---- the small operations of a step (native/step_ops.c) ---------------------------------
#
# Each wrapper takes exactly the reference's arguments and returns what it returns; inputs
# the C code does not take (another dtype or device, a layout it cannot stride through)
# go to the reference itself.


def _native_dtype(*tensors: torch.Tensor) -> bool:
    """All on the CPU, in one dtype the kernels take. (A loop, not `all()` over a
    generator: this runs a hundred times a step.)"""
    dtype = tensors[0].dtype
    if dtype not in DTYPES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu:
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from kernels import norms

    if not (_native_dtype(x, weight) and x.dim() in (2, 3) and x.stride(-1) == 1
            and weight.is_contiguous()):
        return norms.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    rows, inner = (x.shape[0], 1) if x.dim() == 2 else (x.shape[0], x.shape[1])
    inner_stride = 0 if x.dim() == 2 else x.stride(1)
    _loaded().ops["rms_norm"][x.dtype](x.data_ptr(), rows, inner, x.shape[-1], x.stride(0),
                                       inner_stride, weight.data_ptr(), eps, out.data_ptr(),
                                       torch.get_num_threads())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels import norms

    if not (_native_dtype(x, residual, weight) and x.dim() == 2 and x.shape == residual.shape
            and x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
        return norms.fused_add_rms_norm(x, residual, weight, eps)
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    _loaded().ops["add_rms_norm"][x.dtype](x.data_ptr(), residual.data_ptr(), x.shape[0],
                                           x.shape[1], weight.data_ptr(), eps,
                                           out.data_ptr(), summed.data_ptr(),
                                           torch.get_num_threads())
    return out, summed


def _rotatable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.shape[2] == 2 * cos.shape[1]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels import rotary

    if not (_native_dtype(q, k, cos, sin) and _rotatable(q, cos) and _rotatable(k, cos)
            and cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
            and q.shape[0] == k.shape[0] == cos.shape[0]):
        return rotary.apply_rotary(q, k, cos, sin)
    fn = _loaded().ops["rotary"][q.dtype]
    outs = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=x.dtype)
        fn(x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0), x.stride(1),
           cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(),
           torch.get_num_threads())
        outs.append(out)
    return outs[0], outs[1]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from kernels import activation

    if not (_native_dtype(x) and x.dim() == 2 and x.is_contiguous() and x.shape[1] % 2 == 0):
        return activation.silu_and_mul(x)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    _loaded().ops["silu_and_mul"][x.dtype](x.data_ptr(), x.shape[0], x.shape[1] // 2,
                                           out.data_ptr(), torch.get_num_threads())
    return out


def _token_rows(x: torch.Tensor) -> bool:
    """[n, heads, D] whose heads of a token are contiguous (tokens may be strided)"""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def store_kv(k, v, k_cache, v_cache, slot_blocks, slot_offsets) -> None:
    from kernels import attention

    if not (_native_dtype(k, v, k_cache, v_cache) and _token_rows(k) and _token_rows(v)
            and k.shape == v.shape and k_cache.stride() == v_cache.stride()
            and k_cache.dim() == 4 and k_cache.shape[2:] == k.shape[1:]
            and k_cache.stride(3) == 1 and k_cache.stride(2) == k_cache.shape[3]
            and k_cache.stride(1) == k_cache.shape[2] * k_cache.shape[3]
            and slot_blocks.dtype == slot_offsets.dtype == torch.int64
            and slot_blocks.is_contiguous() and slot_offsets.is_contiguous()
            and slot_blocks.numel() == slot_offsets.numel() == k.shape[0]):
        attention.store_kv(k, v, k_cache, v_cache, slot_blocks, slot_offsets)
        return
    _loaded().ops["store_kv"][k.dtype](
        k.data_ptr(), v.data_ptr(), k.shape[0], k.shape[1] * k.shape[2], k.stride(0),
        v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        k_cache.stride(1), slot_blocks.data_ptr(), slot_offsets.data_ptr())


def _decode_lists(decodes) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each decode's table starts in `decodes.all_tables`, and its context length:
    made once per step (every layer reads the same)."""
    cache = decodes.backend_cache
    if cache is None or "native" not in cache:
        starts = [0]
        for table in decodes.block_tables[:-1]:
            starts.append(starts[-1] + table.numel())
        cache = decodes.backend_cache = decodes.backend_cache or {}
        cache["native"] = (torch.tensor(starts, dtype=torch.int64),
                           torch.tensor(decodes.context_lens, dtype=torch.int64))
    return cache["native"]


def _decode(q, k_cache, v_cache, decodes) -> torch.Tensor:
    """Native form of `kernels.attention._decode`: every decode's heads in one call, each
    reading its keys and values straight from the cache blocks (no gather, no padding)."""
    from kernels import attention

    if not (_native_dtype(q, k_cache, v_cache) and q.dim() == 3
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
            and k_cache.stride(2) == k_cache.shape[3] and decodes.all_tables is not None
            and q.shape[1] % k_cache.shape[2] == 0):
        return attention._decode(q, k_cache, v_cache, decodes)
    starts, lens = _decode_lists(decodes)
    q = q.contiguous()
    num_decodes, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    failed = _loaded().ops["decode_attention"][q.dtype](
        q.data_ptr(), num_decodes, num_heads, k_cache.shape[2], head_dim, k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], decodes.all_tables.data_ptr(), starts.data_ptr(), lens.data_ptr(),
        head_dim ** -0.5, out.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("decode attention could not allocate its scratch buffers")
    return out


def paged_attention(q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
    from kernels import attention

    return attention.paged_attention(q, k, v, k_cache, v_cache, meta, decode=_decode)


# ---- every decoder layer of a decode step in one call (native/decoder.c) ------------------


class _DecoderShape(ctypes.Structure):
    # annotated (every field a simple C type) because mypy joins the two lists' items to
    # `type[object]`, which the stub's `_fields_` rejects
    _fields_: ClassVar[Sequence[tuple[str, type[ctypes._SimpleCData[Any]]]]]
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "intermediate", "cache_block_stride",
        "cache_token_stride", "block_size")] + [("eps", ctypes.c_float),
                                                ("scale", ctypes.c_float),
                                                ("panels", ctypes.c_int64)]


LAYER_PARTS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm",
               "gate_up", "gate_up_bias", "down")
# the parts a layer may lack (a bias, Qwen3's per-head norms)
OPTIONAL_PARTS = ("qkv_bias", "q_norm", "k_norm", "gate_up_bias")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (*LAYER_PARTS, "k_cache", "v_cache")]


class NativeDecoder:
    """A Llama-family model's decoder layers run as one native call per decode step of at
    most `max_rows` rows, on the native kernels the layer-by-layer path calls one by one
    (bit for bit its results: same operations, same order).

    Why: at a few rows a layer is its weight reads plus a few kilobytes of small
    operations, and the Python between the calls cost more than the operations (bf16,
    100m model, Xeon with AMX: 4-5 ms of a 13 ms step; docs/benchmarks.md "CPU speed").

    `layers`: per layer, the tensors named by `LAYER_PARTS` (plain row-major weights, or
    with `panels` fp32 projection weights packed by `pack_panels`; the norms' weights;
    None for an absent optional part), all of one dtype the kernels take.
    """

    def __init__(self, layers: list[dict[str, torch.Tensor | None]], *, heads: int,
                 kv_heads: int, head_dim: int, eps: float, max_rows: int,
                 panels: bool = False) -> None:
        library = _loaded()
        first = layers[0]
        # qkv, o, gate_up and down are required (the loop below checks every layer's);
        # layer 0's qkv gives the dtype the others must have
        qkv = first.get("qkv")
        if qkv is None:
            raise ValueError("qkv: a contiguous CPU tensor needed")
        self.dtype = qkv.dtype
        for layer in layers:
            for name in LAYER_PARTS:
                t = layer.get(name)
                if t is None and name in OPTIONAL_PARTS:
                    continue
                if t is None or t.dtype != self.dtype or not t.is_cpu or not t.is_contiguous() \
                        or t.is_mkldnn:
                    raise ValueError(f"{name}: a contiguous CPU tensor of {self.dtype} needed")
            if (layer.get("q_norm") is None) != (layer.get("k_norm") is None):
                raise ValueError("q_norm and k_norm come together")
        if self.dtype not in DTYPES:
            raise ValueError(f"the native kernels take {DTYPES}, not {self.dtype}")
        if panels and self.dtype != torch.float32:
            raise ValueError(f"panels hold fp32 weights, not {self.dtype}")
        # a weight [out, in] or its panels [ceil(out / width), in, width]: `in` is dim 1
        hidden = qkv.shape[1]
        intermediate = cast(torch.Tensor, first["down"]).shape[1]
        qkv_rows = (heads + 2 * kv_heads) * head_dim
        if panels:
            width = library.panel_width
            projections = (cast(torch.Tensor, layer[name])
                           for layer in layers for name in ("qkv", "o", "gate_up", "down"))
            if any(w.dim() != 3 or w.shape[2] != width for w in projections):
                raise ValueError(f"panels of width {width} needed")
            qkv_rows = -(-qkv_rows // width)
        if qkv.shape[0] != qkv_rows or heads % kv_heads:
            raise ValueError("qkv does not match the heads")
        self._library = library
        self._run = library.decode_layers[self.dtype]
        self.max_rows = max_rows
        self.num_layers = len(layers)
        self._layers = layers  # the tensors stay alive as long as their addresses are used
        self._structs = (_Layer * len(layers))()
        for struct, layer in zip(self._structs, layers):
            for name in LAYER_PARTS:
                t = layer.get(name)
                setattr(struct, name, None if t is None else t.data_ptr())
        self._shape = _DecoderShape(hidden=hidden, heads=heads, kv_heads=kv_heads,
                                    head_dim=head_dim, intermediate=intermediate,
                                    eps=eps, scale=head_dim ** -0.5, panels=int(panels))
        self._cache_ptr: int | None = None
        self._scratch = torch.empty(0, dtype=self.dtype)

    def takes(self, hidden: torch.Tensor, meta) -> bool:
        """True when this step can run here: every row a decode (no prompt chunk attended
        apart), at most `max_rows` of them, in the decoder's dtype, on the CPU."""
        decodes = meta.decodes
        return (decodes is not None and decodes.rows_are_all and not meta.chunks
                and hidden.shape[0] <= self.max_rows and hidden.dtype == self.dtype
                and hidden.is_cpu and decodes.all_tables is not None)

    def _bind_cache(self, kv_cache: torch.Tensor) -> None:
        """Point every layer at its K and V in `kv_cache` [blocks, 2, layers, block_size,
        kv_heads, head_dim] (contiguous); done again only if the cache moves."""
        if kv_cache.data_ptr() == self._cache_ptr:
            return
        shape = self._shape
        if not (kv_cache.is_contiguous() and kv_cache.dim() == 6 and kv_cache.dtype == self.dtype
                and kv_cache.shape[2] == self.num_layers
                and kv_cache.shape[4:] == (shape.kv_heads, shape.head_dim)):
            raise ValueError(f"a KV cache of shape {tuple(kv_cache.shape)} does not fit")
        for layer, struct in enumerate(self._structs):
            struct.k_cache = kv_cache[:, 0, layer].data_ptr()
            struct.v_cache = kv_cache[:, 1, layer].data_ptr()
        shape.cache_block_stride = kv_cache.stride(0)
        shape.cache_token_stride = kv_cache.stride(3)
        shape.block_size = kv_cache.shape[3]
        self._cache_ptr = kv_cache.data_ptr()

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta, stop: StopFlag | None = None,
                 stop_before: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [rows, hidden_size] (the embeddings) -> (hidden, residual) after the
        last layer, as the layer loop returns them. cos, sin [rows, head_dim / 2].
        `stop`: read before each of the first `stop_before` layers; once set (by any
        thread), the call gives the step up and raises `DecoderStopped`."""
        self._bind_cache(meta.kv_cache)
        rows = hidden.shape[0]
        hidden = hidden.clone(memory_format=torch.contiguous_format)
        residual = torch.empty_like(hidden)
        needed = self._library.decode_scratch(ctypes.byref(self._shape), rows)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=self.dtype)
        if not (cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
                and cos.dtype == sin.dtype == self.dtype):
            cos, sin = cos.contiguous().to(self.dtype), sin.contiguous().to(self.dtype)
        decodes = meta.decodes
        starts, lens = _decode_lists(decodes)
        failed = self._run(ctypes.byref(self._shape), self._structs, self.num_layers, rows,
                           hidden.data_ptr(), residual.data_ptr(), 0, cos.data_ptr(),
                           sin.data_ptr(), cos.stride(0), meta.slot_blocks.data_ptr(),
                           meta.slot_offsets.data_ptr(), decodes.all_tables.data_ptr(),
                           starts.data_ptr(), lens.data_ptr(), self._scratch.data_ptr(),
                           None if stop is None else stop.address, stop_before,
                           torch.get_num_threads())
        if failed > 0:
            raise DecoderStopped(failed - 1)
        if failed:
            raise MemoryError("decode attention or a projection could not allocate its "
                              "scratch buffers")
        return hidden, residual


class StopFlag:
    """An int in memory the native decoder reads between layers without the GIL: `set()`
    from any thread asks a running decoder call to give its step up; `clear()` before
    the next."""

    __slots__ = ("_value", "address")

    def __init__(self) -> None:
        self._value = ctypes.c_int32(0)
        self.address = ctypes.addressof(self._value)

    def set(self) -> None:
        self._value.value = 1

    def clear(self) -> None:
        self._value.value = 0

    def is_set(self) -> bool:
        return bool(self._value.value)


class DecoderStopped(Exception):
    """A `NativeDecoder` call gave its step up before layer `layer` (its `StopFlag`)."""

    def __init__(self, layer: int) -> None:
        super().__init__(f"stopped before layer {layer}")
        self.layer = layer


# prompt chunks of at most this many tokens go to the decode kernel, one row per query
# (kernels.attention.build_attention_metadata): each row reads its keys again, which for
# short chunks costs less than an attention call and a gather per chunk and layer
CHUNK_AS_DECODES_TOKENS = 64

# the kernels `register` puts in `kernels.dispatch` for the CPU
STEP_KERNELS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "apply_rotary": apply_rotary,
    "silu_and_mul": silu_and_mul,
    "store_kv": store_kv,
    "paged_attention": paged_attention,
}


def register() -> bool:
    """Use the native step kernels on the CPU (kernels.dispatch); False when the library
    is unavailable (the references stay)."""
    from kernels import dispatch

    if not available():
        return False
    for name, fn in STEP_KERNELS.items():
        dispatch.register(name, "cpu", fn)
    return True


def unregister() -> None:
    """Back to the pure-torch references on the CPU."""
    from kernels import dispatch

    for name in STEP_KERNELS:
        dispatch.unregister(name, "cpu")
