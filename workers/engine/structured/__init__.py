"""Structured outputs on the engine side: a grammar backend (xgrammar) compiles each
request's constraint off the step's critical path, a per-sequence matcher follows its
tokens, and the `StructuredOutputManager` fills the step's token bitmask rows."""

from workers.engine.structured.manager import StructuredOutputManager
from workers.engine.structured.sequence_grammar import SequenceGrammar

__all__ = ["SequenceGrammar", "StructuredOutputManager"]
