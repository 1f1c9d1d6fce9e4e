"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before rotary
(`q_norm`, `k_norm`), no q/k/v bias unless the config asks.

`ModelConfig.from_hf` sets `qk_norm=True` for this architecture.
"""

from __future__ import annotations

from workers.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
