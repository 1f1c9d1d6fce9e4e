"""Dense projections `x @ W^T + b`, and the CPU's faster paths for them: weights prepacked
once, at start-up, into oneDNN's blocked layout for this CPU's ISA, and our own kernel for
calls of few rows (kernels/native.py), which reads the plain weights as they are.

Why: torch's default CPU `linear` repacks the weight on every call and picks a poor
small-M kernel on some CPUs (Zen 4 fp32: 2-3x slower than the prepacked oneDNN call at
M=16, and half its read bandwidth at M=1; docs/benchmarks.md "CPU speed"). A prepacked
weight is an opaque oneDNN tensor: it can only be multiplied, never indexed or moved, so
layers swap it in after loading, on the device it runs on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native
from kernels.cpu import has_native_bf16
from kernels.timing import alternated_medians

# dtypes oneDNN's prepacked linear takes on CPU (fp16 has no fast x86 path)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# the batch size the blocked layout is tuned for; any M runs on it (decode batches are
# 1..max_num_seqs rows, prefills hundreds)
PACK_BATCH_HINT = 16
# the row counts the start-up timing compares the paths at
PROBE_BATCH_SIZES = (1, 2, 4, 8, 16)
# and, for bf16 weights on a CPU without native bf16, these too: the native kernel (which
# widens the weight as it streams in) outruns a widened fp32 GEMM well past 16 rows there
# (100m model's weights, AVX-512 without BF16: 32 rows 48 against 79 ms, 64 rows 92
# against 102, 128 rows 174 against 142; AVX2: 32 rows 80 against 116, 64 rows 148
# against 102; docs/benchmarks.md), so where the two cross is measured too
WIDE_PROBE_BATCH_SIZES = (32, 64)
# a path this many times slower than the fastest after a few rounds is timed no more
DROP_SLOWER = 1.5
# from this many rows a bf16 call on a CPU without native bf16 that the native kernel does
# not take is computed in fp32 (`widened_linear`): torch's bf16 `linear` there costs about
# 9 ms a row per pass over the 100m model's weights, widening a fixed ~100 ms (Zen 3). At
# 16 rows the layers' weights gain (74 -> 43 ms) and the LM head's larger fresh copy about
# breaks even; from 64 rows every weight gains (a 64-row decode step: 3.1x faster)
WIDEN_ROWS = 16


def can_prepack(weight: torch.Tensor) -> bool:
    """True when `weight` [out, in] can take the prepacked path on its device. bf16 weights
    are packed only where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): oneDNN
    packs them on any AVX-512 CPU, but without those instructions its bf16 GEMM converts
    every operand and loses to the native kernel at every row count and to `widened_linear`
    at large ones (AVX-512 without BF16, the 100m model's weights: 1 row 12.0 against 8.7 ms
    native, 64 rows 230 against 92 native and 102 widened); on AVX2 it cannot pack them."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and not weight.is_mkldnn
            and packs_dtype(weight.dtype))


def packs_dtype(dtype: torch.dtype) -> bool:
    """True when CPU weights of `dtype` take the prepacked path here (`can_prepack`)."""
    return (dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and (dtype != torch.bfloat16 or (onednn_packs_bf16() and has_native_bf16())))


@functools.cache
def onednn_packs_bf16() -> bool:
    """True where oneDNN has bf16 kernels on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT):
    bf16 weights can be prepacked; elsewhere (AVX2) bf16 has no fast GEMM."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `weight` [out, in] (call only when `can_prepack`; a bf16
    weight where `can_prepack_widened`: its fp32 copy, which `linear` takes for bf16 x)."""
    with torch.inference_mode(False), torch.no_grad():
        weight = weight.detach()
        if can_prepack_widened(weight):
            weight = weight.float()
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def can_prepack_widened(weight: torch.Tensor) -> bool:
    """True for a bf16 CPU weight that cannot be prepacked as bf16 here (no bf16 dot
    products) but whose fp32 copy can: a prepacked fp32 copy computes the calls of many
    rows as `widened_linear` does, without widening the weight on every call (Zen 3, a
    pass over the 100m model's weights: 32 rows 78 against 201 ms, 64 rows 127 against
    256, 256 rows 406 against 509; docs/benchmarks.md). It doubles the
    weight's bytes on top of the plain bf16 weight the native kernel keeps reading at few
    rows, so the runner packs these copies only where they fit in memory."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and not weight.is_mkldnn and not packs_dtype(torch.bfloat16)
            and packs_dtype(torch.float32))


def can_prepack_any(weight: torch.Tensor, widen: bool) -> bool:
    """What `prepack` takes: `can_prepack`, and with `widen` also `can_prepack_widened`."""
    return can_prepack(weight) or (widen and can_prepack_widened(weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           skinny_rows: int = 0) -> torch.Tensor:
    """`x @ weight^T + bias`; `weight` plain [out, in] or `prepack`ed. A plain weight
    multiplies calls of at most `skinny_rows` rows with the native kernel
    (kernels/native.py), larger ones with torch's `linear` (a bf16 weight on a CPU
    without native bf16: `widened_linear`)."""
    if weight.is_mkldnn:
        if weight.dtype != x.dtype:  # a bf16 weight's widened copy: as `widened_linear`
            return linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if x.shape[0] <= skinny_rows:
        return native.skinny_linear(x, weight, bias)
    if (x.shape[0] >= WIDEN_ROWS and weight.dtype == torch.bfloat16 and weight.is_cpu
            and not has_native_bf16()):
        return widened_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def widened_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 `linear` computed in fp32 and rounded once, as a bf16 linear rounds: on a CPU
    without native bf16 (AVX2, or AVX-512 without BF16), torch's bf16 `linear` runs 3-6x
    slower than widening the weight and multiplying in fp32 (Zen 3, the 100m model's
    weights: 16 rows 74 against 43 ms, 256 rows 1,192 against 199 ms; docs/benchmarks.md).
    The fp32 copy of the weight lives for the call only; widening it costs three passes
    over its bytes, so calls of fewer than `WIDEN_ROWS` rows stay on torch's bf16 `linear`
    (1 row: 14.5 against 105 ms)."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def probe_batch_sizes(weights: list[torch.Tensor]) -> tuple[int, ...]:
    """The row counts `time_paths` compares the paths at for these weights: also 32 and 64
    where the native kernel can outrun the GEMMs past 16 rows (fp32 weights in panels; bf16
    weights on a CPU without bf16 dot products)."""
    if any(w.dtype == torch.bfloat16 and w.is_cpu for w in weights) and not has_native_bf16():
        return PROBE_BATCH_SIZES + WIDE_PROBE_BATCH_SIZES
    if weights and all(native.panels_supported(w) for w in weights):
        return PROBE_BATCH_SIZES + WIDE_PROBE_BATCH_SIZES
    return PROBE_BATCH_SIZES


def time_paths(weights: list[torch.Tensor], batch_sizes: tuple[int, ...] | None = None,
               rounds: int = 7, widen: bool = False) -> dict[int, dict[str, float]]:
    """Per batch size M, per path: the median seconds of `x [M, in] @ w^T` summed over
    `weights`. Paths: "reference" (torch's `linear`), "prepacked" (oneDNN, when every
    weight can be packed; with `widen`, bf16 weights' fp32 copies where
    `can_prepack_widened`), "native" (kernels/native.py, when it builds here: fp32
    weights packed in panels where `native.panels_supported`, else the plain weights).

    Which path wins depends on the CPU, the dtype, M and the threads (on a Xeon with AMX,
    fp32 at M=1 reads faster through MKL; bf16 through oneDNN at every M; on Zen 4 the
    native kernel reads fastest at few rows), so it is measured on the model's own shapes
    rather than assumed. The paths take turns, round by round and in a rotating order, so
    a neighbour's load falls on all of them."""
    batch_sizes = probe_batch_sizes(weights) if batch_sizes is None else batch_sizes
    # per path, one function per weight: x -> x @ w^T
    calls: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "reference": [functools.partial(linear, weight=w) for w in weights]}
    if all(can_prepack_any(w, widen) for w in weights):
        calls["prepacked"] = [functools.partial(linear, weight=prepack(w)) for w in weights]
    if weights and all(native.panels_supported(w) for w in weights):
        calls["native"] = [functools.partial(native.panel_linear, panels=native.pack_panels(w),
                                             out_features=w.shape[0]) for w in weights]
    elif all(native.supports(w) for w in weights):
        calls["native"] = [functools.partial(linear, weight=w, skinny_rows=max(batch_sizes))
                           for w in weights]
    result: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for m in batch_sizes:
            xs = [torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]

            def run(path: list[Callable[[torch.Tensor], torch.Tensor]], xs=xs) -> None:
                for x, multiply in zip(xs, path):
                    multiply(x)

            # (a path 1.5x slower than the fastest after 3 rounds cannot win: torch's fp32
            # `linear` at every row count on Zen 4, about half of the timing's seconds)
            result[m] = alternated_medians(
                {name: functools.partial(run, path) for name, path in calls.items()}, rounds,
                drop_slower=DROP_SLOWER)
    return result


def describe_times(times: dict[int, dict[str, float]]) -> str:
    """`time_paths`' figures for a log line: milliseconds per pass, by row count and path."""
    return "; ".join(f"batch {m} " + ", ".join(f"{name} {t * 1e3:.2f}"
                                               for name, t in by_path.items())
                     for m, by_path in times.items())


@dataclass(frozen=True)
class LinearPlan:
    """Which kernel takes a projection call of M rows, from `time_paths`.

    Calls of at most `skinny_rows` rows take the native kernel; then, with `prepack`,
    calls of at most `plain_rows` rows take torch's `linear` on the plain weight and
    larger ones the prepacked copy (`plain_rows` None: the plain weight is freed);
    without, torch's `linear` takes the rest."""

    name: str  # "reference", "prepacked", "split" or "native"
    prepack: bool = False
    plain_rows: int | None = None
    skinny_rows: int = 0


def choose_plan(times: dict[int, dict[str, float]]) -> LinearPlan:
    """The plan `time_paths`' figures argue for: the native kernel for every call up to
    the row count where handing it that range (and the other paths the rest, each at its
    best) costs least over all the probed row counts, then oneDNN's prepacked path or
    torch's `linear`, whichever wins above (a split where each wins a range).

    One cutoff, chosen on the sum: a kernel within a few percent at one row and a third
    faster from 8 rows on (fp32 panels on a Xeon with AVX-512) takes the whole range,
    where a cutoff at the first row it loses would hand it nothing."""
    sizes = sorted(times)

    def others(m: int) -> float:
        return min(t for name, t in times[m].items() if name != "native")

    skinny_rows, best = 0, sum(others(m) for m in sizes)
    for cutoff in sizes:
        if any("native" not in times[m] for m in sizes if m <= cutoff):
            break
        total = sum(times[m]["native"] if m <= cutoff else others(m) for m in sizes)
        if total < best:
            skinny_rows, best = cutoff, total
    rest = [m for m in sizes if m > skinny_rows] or sizes[-1:]
    if "prepacked" not in times[rest[0]]:
        return LinearPlan("native" if skinny_rows else "reference", skinny_rows=skinny_rows)
    ratios = {m: times[m]["prepacked"] / times[m]["reference"] for m in rest}
    limit = plain_rows_limit(ratios)
    if skinny_rows:
        if limit is None and all(r >= 1.0 for r in ratios.values()):
            return LinearPlan("native", skinny_rows=skinny_rows)  # torch's linear above
        return LinearPlan("native", prepack=True, plain_rows=limit or skinny_rows,
                          skinny_rows=skinny_rows)
    if limit is not None:
        return LinearPlan("split", prepack=True, plain_rows=limit)
    if sum(ratios.values()) < len(ratios):
        return LinearPlan("prepacked", prepack=True)
    return LinearPlan("reference")


def plain_rows_limit(ratios: dict[int, float]) -> int | None:
    """From the ratios of prepacked over torch's `linear` time per M: None when one path
    wins at every probed M (the caller keeps that one alone); else the largest M up to
    which torch's `linear` is faster while prepacking wins above it: keep both copies and
    split the calls there.

    NOTE: a split doubles the projection weights' memory; it is what a Xeon with AMX
    gives in fp32 (MKL reads faster at M=1, oneDNN's packing wins at M=16)."""
    sizes = sorted(ratios)
    plain = [m for m in sizes if ratios[m] >= 1.0]
    if not plain or len(plain) == len(sizes):
        return None
    limit = max(plain)
    if any(ratios[m] >= 1.0 for m in sizes if m > limit) or any(
            ratios[m] < 1.0 for m in sizes if m <= limit):
        return None  # no single crossover (noise): one path for every M
    return limit
