"""Which model class serves which checkpoint `architectures` name."""

from __future__ import annotations

from torch import nn

from workers.engine.models.llama import LlamaForCausalLM
from workers.engine.models.qwen2 import Qwen2ForCausalLM
from workers.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# config.json `model_type` -> architecture, for configs without `architectures`
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}


def resolve_architecture(architectures: list[str] | None, model_type: str | None) -> str:
    """The architecture name we serve for this config; ValueError names what we support."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return name
    if not architectures and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"architecture {architectures or model_type!r} is not supported; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
