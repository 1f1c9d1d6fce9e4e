"""Qwen2: the Llama decoder with a bias on the q, k and v projections (always on).

`ModelConfig.from_hf` sets `attention_bias=True` for this architecture.
"""

from __future__ import annotations

from workers.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
