"""Dense projections `x @ W^T + b`, and the CPU's faster path for them: weights prepacked
once, at start-up, into oneDNN's blocked layout for this CPU's ISA.

Why: torch's default CPU `linear` repacks the weight on every call and picks a poor
small-M kernel on some CPUs (Zen 4 fp32: 2-3x slower than the prepacked oneDNN call at
M=16, and half its read bandwidth at M=1; docs/benchmarks.md "CPU speed"). A prepacked
weight is an opaque oneDNN tensor: it can only be multiplied, never indexed or moved, so
layers swap it in after loading, on the device it runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# dtypes oneDNN's prepacked linear takes on CPU (fp16 has no fast x86 path)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# the batch size the blocked layout is tuned for; any M runs on it (decode batches are
# 1..max_num_seqs rows, prefills hundreds)
PACK_BATCH_HINT = 16


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
