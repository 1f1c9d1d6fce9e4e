"""The device-group service (Celery worker, batcher, writer, publisher, heartbeat) and,
in `workers.engine`, the engine it drives.

`from workers import LLM, SamplingParams, StructuredOutputs` is the offline API. Heavy
modules (torch) load on first use, so importing a plain-data module of this package stays
cheap.
"""

from typing import Any

from tasks.params import SamplingParams
from tasks.structured import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from workers.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
