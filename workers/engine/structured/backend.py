"""The grammar backend: xgrammar behind the few calls the engine makes.

Why xgrammar (measured on this machine, vocab 32k, a 20-field JSON schema; see
docs/benchmarks.md): it precomputes the token masks of a grammar when it compiles it
(~75-110 ms, off the step on the compile thread, then cached), so filling one row's
bitmask during a step costs ~1 us; llguidance compiles in ~1-10 ms but computes masks
lazily, ~10 us median and ~100 us at p99 per row per step, on the step's critical path.

NOTE: xgrammar is imported on first use only: an engine that never sees a constrained
request never loads it.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Protocol, cast

import numpy as np

from tasks.structured import (
    InvalidStructuredOutputsError,
    StructuredKind,
    StructuredOutputs,
)

logger = logging.getLogger(__name__)


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar (xgrammar's `GrammarMatcher`)."""

    def accept_token(self, token_id: int) -> bool: ...

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any: ...

    def is_terminated(self) -> bool: ...


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: bit j of word w allows token 32 * w + j."""
    return (vocab_size + 31) // 32


class XgrammarBackend:
    """Checks and compiles `StructuredOutputs` for one tokenizer and vocabulary.

    `check()` is cheap (parses the schema, regex or grammar without the vocabulary, well
    under a millisecond) and runs in `Engine.add_request`; `compile()` builds the token
    masks (tens to hundreds of milliseconds) and runs on the compile thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the model's embedding rows)
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()

    def check(self, spec: StructuredOutputs) -> None:
        """Raise InvalidStructuredOutputsError with the backend's message when the
        schema, regex or grammar does not parse (or uses what the backend does not
        support)."""
        import xgrammar

        kind = spec.kind
        try:
            if kind is StructuredKind.JSON:
                xgrammar.Grammar.from_json_schema(spec.schema_text(), any_whitespace=False)
            elif kind is StructuredKind.REGEX:
                xgrammar.Grammar.from_regex(cast(str, spec.regex))  # set: kind REGEX
            elif kind in (StructuredKind.GRAMMAR, StructuredKind.CHOICE):
                xgrammar.Grammar.from_ebnf(_ebnf(spec))
        except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
            raise InvalidStructuredOutputsError(
                f"structured_outputs.{kind.value} is not usable: {_backend_message(exc)}"
            ) from exc

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar (xgrammar `CompiledGrammar`); raises
        InvalidStructuredOutputsError when the backend rejects the constraint."""
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind in (StructuredKind.JSON, StructuredKind.JSON_OBJECT):
                return compiler.compile_grammar(_json_schema_ebnf(spec))
            if kind is StructuredKind.REGEX:
                return compiler.compile_regex(spec.regex)
            return compiler.compile_grammar(_ebnf(spec))
        except Exception as exc:
            raise InvalidStructuredOutputsError(
                f"structured_outputs.{kind.value} is not usable: {_backend_message(exc)}"
            ) from exc

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:  # [num_rows, words] int32
        return np.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=np.int32)

    def _get_compiler(self) -> Any:
        # NOTE: the tokenizer's vocabulary is read once (~0.1-0.2 s at 32k tokens), on the
        # compile thread, by the first constrained request.
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids)
                # NOTE: one compile thread of our own; xgrammar's own threads would
                # compete with the model step for the same cores.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                          cache_enabled=False)
            return self._compiler


# NOTE: xgrammar 0.2.8 writes the characters of a length-bounded JSON string (minLength /
# maxLength) as _LOOSE_STRING_CHAR, which lets raw control characters (U+0000-U+001F) in:
# the output is then not JSON (json.loads refuses it). Its unbounded strings exclude them;
# so do we.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def _json_schema_ebnf(spec: StructuredOutputs) -> str:
    """The EBNF of a JSON schema (`{"type": "object"}` for json_object), compact
    separators, with string characters restricted to what JSON allows."""
    import xgrammar

    schema = spec.schema_text() if spec.kind is StructuredKind.JSON else '{"type": "object"}'
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def _ebnf(spec: StructuredOutputs) -> str:
    if spec.kind is StructuredKind.CHOICE:
        assert spec.choice is not None
        # NOTE: a JSON string literal is an EBNF string literal (same escapes)
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    assert spec.grammar is not None
    return spec.grammar


def _backend_message(exc: Exception) -> str:
    """xgrammar's message without its source location prefix ("[time] file.cc:83: ")."""
    text = str(exc).strip()
    head, sep, rest = text.partition(".cc:")
    if sep and ": " in rest:
        return rest.split(": ", 1)[1].strip()
    return text or type(exc).__name__
