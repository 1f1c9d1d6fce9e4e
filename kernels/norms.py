"""RMSNorm, plain and with the residual add fused in (the reference implementations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim, computed in float32 like the HF models.

    NOTE: `F.rms_norm` is one fused pass where the textbook formula is six elementwise
    kernels; on CPU it gives the same float32 results bit for bit as HF's
    `x * rsqrt(mean(x**2) + eps)` (tests/test_kernels.py checks it against `LlamaRMSNorm`).
    For lower-precision inputs HF casts the normalized value back BEFORE the weight
    multiply, so only the float32 case takes the weight inside the fused op.
    """
    shape = (x.shape[-1],)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(rms_norm(x + residual), x + residual)`: the next layer's input and residual."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
