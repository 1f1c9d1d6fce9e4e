"""Gated activation of the MLP (the reference implementation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = cat([gate, up], -1)`: [..., 2 * d] -> [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
