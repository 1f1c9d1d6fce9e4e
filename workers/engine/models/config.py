"""`ModelConfig`: the model shape our layers need, read from a Hugging Face config.json.

Plain data: the loader builds it once and every layer reads its sizes from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(slots=True)
class ModelConfig:
    arch: str  # the `architectures[0]` name, e.g. "Qwen3ForCausalLM"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or {"rope_type": "linear"|"llama3", ...}
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always, Llama optionally)
    max_position_embeddings: int
    dtype: torch.dtype
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], arch: str, dtype: torch.dtype) -> ModelConfig:
        """Read a config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_scaling = dict(hf.get("rope_scaling") or {}) or None
        rope_theta = float(hf.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"config.json: rope scaling type {rope_type!r} is not supported; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            rope_scaling["rope_type"] = rope_type
            if rope_type == "default":
                rope_scaling = None
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            arch=arch,
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else bool(hf.get("attention_bias", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            dtype=dtype,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )
