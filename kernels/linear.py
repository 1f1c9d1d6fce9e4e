"""Dense projections `x @ W^T + b`, and the CPU's faster path for them: weights prepacked
once, at start-up, into oneDNN's blocked layout for this CPU's ISA.

Why: torch's default CPU `linear` repacks the weight on every call and picks a poor
small-M kernel on some CPUs (Zen 4 fp32: 2-3x slower than the prepacked oneDNN call at
M=16, and half its read bandwidth at M=1; docs/benchmarks.md "CPU speed"). A prepacked
weight is an opaque oneDNN tensor: it can only be multiplied, never indexed or moved, so
layers swap it in after loading, on the device it runs on.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

# dtypes oneDNN's prepacked linear takes on CPU (fp16 has no fast x86 path)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# the batch size the blocked layout is tuned for; any M runs on it (decode batches are
# 1..max_num_seqs rows, prefills hundreds)
PACK_BATCH_HINT = 16
# the row counts the start-up timing compares the two paths at
PROBE_BATCH_SIZES = (1, 4, 16)


def can_prepack(weight: torch.Tensor) -> bool:
    """True when `weight` [out, in] can take the prepacked path on its device."""
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES
            and weight.dim() == 2 and torch.backends.mkldnn.is_available()
            and not weight.is_mkldnn)


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of `weight` [out, in] (call only when `can_prepack`)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight^T + bias`; `weight` plain [out, in] or `prepack`ed."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepacked_speedup(weights: list[torch.Tensor],
                      batch_sizes: tuple[int, ...] = PROBE_BATCH_SIZES,
                      rounds: int = 7) -> dict[int, float]:
    """Per batch size M: median time of the prepacked path over torch's `linear` for
    `x [M, in] @ w^T` summed over `weights` (below 1: prepacking wins).

    Which path wins depends on the CPU, the dtype, M and the threads (on a Xeon with AMX,
    fp32 at M=1 reads faster through MKL; bf16 through oneDNN at every M), so it is
    measured on the model's own shapes rather than assumed. The two paths take turns,
    round by round, so a neighbour's load falls on both."""
    packed = [prepack(w) for w in weights]
    ratios: dict[int, float] = {}
    with torch.inference_mode():
        for m in batch_sizes:
            xs = [torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
            times: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(rounds + 1):
                for use_packed in (False, True) if round_ % 2 else (True, False):
                    start = time.perf_counter()
                    for x, w, p in zip(xs, weights, packed):
                        linear(x, p if use_packed else w)
                    if round_:  # the first round warms both paths up
                        times[use_packed].append(time.perf_counter() - start)
            ratios[m] = statistics.median(times[True]) / statistics.median(times[False])
    return ratios


def plain_rows_limit(ratios: dict[int, float]) -> int | None:
    """From `prepacked_speedup`'s ratios: None when one path wins at every probed M (the
    caller keeps that one alone); else the largest M up to which torch's `linear` is
    faster while prepacking wins above it: keep both copies and split the calls there.

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
