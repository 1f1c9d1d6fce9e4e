"""Kernels: RMSNorm, rotary embedding, gated activation, paged attention, sampling.

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


def apply_penalties(logits, repetition_keys, repetition_penalties, count_keys,
                    presence_frequency) -> torch.Tensor:
    """Repetition, then presence / frequency penalties over flat keys `row * vocab + token`
    of logits [num_rows, vocab]; `logits` itself when both key tensors are None."""
    return dispatch.get("apply_penalties", logits.device.type)(
        logits, repetition_keys, repetition_penalties, count_keys, presence_frequency)


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor,
                        rows: list[int]) -> torch.Tensor:
    """x [num_rows, vocab] with the tokens that bitmask [len(rows), ceil(vocab / 32)] int32
    does not allow in each of `rows` set to -inf, in place."""
    return dispatch.get("apply_token_bitmask", x.device.type)(x, bitmask, rows)


def greedy_sample(x: torch.Tensor) -> torch.Tensor:
    """The argmax [num_rows] of each row of x [num_rows, vocab] (first index on ties)."""
    return dispatch.get("greedy_sample", x.device.type)(x)


def filter_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x [num_rows, vocab] with tokens below min_p [num_rows, 1] times the best set to -inf."""
    return dispatch.get("filter_min_p", x.device.type)(x, min_p)


def sample_by_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one column per row of probs [num_rows, n] by u [num_rows]."""
    return dispatch.get("sample_by_cdf", probs.device.type)(probs, u)


def top_k_top_p_sample(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       u: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """One token per row of x [num_rows, vocab] within its top-k [num_rows, 1], then its
    top-p nucleus [num_rows, 1], drawn by u [num_rows]."""
    return dispatch.get("top_k_top_p_sample", x.device.type)(x, top_k, top_p, u,
                                                             num_candidates)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int],
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of token_ids[rows], top-n logprobs, their ids) of logits[rows]."""
    return dispatch.get("gather_logprobs", logits.device.type)(logits, token_ids, rows,
                                                               num_top)


__all__ = [
    "apply_penalties",
    "apply_rotary",
    "apply_token_bitmask",
    "dispatch",
    "filter_min_p",
    "fused_add_rms_norm",
    "gather_logprobs",
    "greedy_sample",
    "paged_attention",
    "rms_norm",
    "sample_by_cdf",
    "silu_and_mul",
    "store_kv",
    "top_k_top_p_sample",
]
