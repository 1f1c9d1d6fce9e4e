"""Kernels: RMSNorm, rotary embedding, gated activation, paged attention.

Call them through these functions: each forwards to the implementation `kernels.dispatch`
chose for the tensors' device (the pure-torch reference unless a backend registered one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernels import dispatch

if TYPE_CHECKING:
    import torch

    from kernels.attention import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim (float32 inside)."""
    return dispatch.get("rms_norm", x.device.type)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`."""
    return dispatch.get("fused_add_rms_norm", x.device.type)(x, residual, weight, eps)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary of q [n, H, D] and k [n, KVH, D] by cos, sin [n, D // 2]."""
    return dispatch.get("apply_rotary", q.device.type)(q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `x = cat([gate, up], -1)`."""
    return dispatch.get("silu_and_mul", x.device.type)(x)


def store_kv(k, v, k_cache, v_cache, slot_blocks, slot_offsets) -> None:
    """Write k, v [n, KVH, D] into their (block, offset) slots of one layer's cache."""
    dispatch.get("store_kv", k.device.type)(k, v, k_cache, v_cache, slot_blocks, slot_offsets)


def paged_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    """Attention of q [n, H, D] over each sequence's cached context -> [n, H * D]."""
    return dispatch.get("paged_attention", q.device.type)(q, k, v, k_cache, v_cache, meta)


__all__ = [
    "apply_rotary",
    "dispatch",
    "fused_add_rms_norm",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]
