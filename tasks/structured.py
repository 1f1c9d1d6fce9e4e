"""`StructuredOutputs`: a request's constraint on what it may generate (plain data).

Exactly one of:
* `json`: a JSON schema, as a dict or a JSON string; the output is one JSON value that
  validates against it;
* `regex`: the output fully matches the regular expression;
* `choice`: the output is exactly one of the listed strings;
* `grammar`: an EBNF grammar (GBNF-style, `root ::= ...`, the grammar backend's language);
* `json_object=True`: the output is any JSON object.

The web imports this module (no torch, no grammar backend): `validate()` checks the shape
of the constraint and, without the backend, what the backend would refuse or ignore
(`tasks/structured_check.py`: JSON-schema keywords, regex constructs, a grammar's root rule
and brackets); the engine's grammar backend (`workers/engine/structured/`) parses it again
and fails the request alone with the backend's message when it does not compile.
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tasks.structured_check import ConstraintError, check_ebnf, check_json_schema, check_regex

MAX_CHOICES = 1024
MAX_SPEC_CHARS = 100_000  # of a schema, regex, grammar or all choices together


class InvalidStructuredOutputsError(ValueError):
    """The constraint is malformed; the message names the field and what to give."""


class StructuredKind(str, Enum):
    JSON = "json"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    JSON_OBJECT = "json_object"


@dataclass(slots=True)
class StructuredOutputs:
    json: dict[str, Any] | str | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (`root ::= ...`)
    json_object: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> StructuredKind:
        if self.json is not None:
            return StructuredKind.JSON
        if self.regex is not None:
            return StructuredKind.REGEX
        if self.choice is not None:
            return StructuredKind.CHOICE
        if self.grammar is not None:
            return StructuredKind.GRAMMAR
        return StructuredKind.JSON_OBJECT

    def validate(self) -> None:
        """Raise InvalidStructuredOutputsError unless exactly one constraint is given and
        it has the right type (a JSON string schema is parsed and must be an object or a
        boolean)."""
        given = [name for name, set_ in (
            ("json", self.json is not None), ("regex", self.regex is not None),
            ("choice", self.choice is not None), ("grammar", self.grammar is not None),
            ("json_object", self.json_object is True)) if set_]
        if not isinstance(self.json_object, bool):
            raise InvalidStructuredOutputsError(
                f"structured_outputs.json_object must be true or false, got "
                f"{self.json_object!r}")
        if len(given) != 1:
            raise InvalidStructuredOutputsError(
                "structured_outputs must give exactly one of json, regex, choice, grammar or "
                f"json_object=true; got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            schema = _parse_schema(self.json)
            if not isinstance(schema, (dict, bool)):
                raise InvalidStructuredOutputsError(
                    "structured_outputs.json must be a JSON schema (an object), got "
                    f"{type(schema).__name__}")
            _checked(check_json_schema, schema, "structured_outputs.json")
        for name, text in (("regex", self.regex), ("grammar", self.grammar)):
            if text is not None:
                if not isinstance(text, str) or not text:
                    raise InvalidStructuredOutputsError(
                        f"structured_outputs.{name} must be a non-empty string")
                _check_size(name, len(text))
                _checked(check_regex if name == "regex" else check_ebnf, text,
                         f"structured_outputs.{name}")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, list) or not 1 <= len(choice) <= MAX_CHOICES or not all(
                    isinstance(c, str) and c for c in choice):
                raise InvalidStructuredOutputsError(
                    "structured_outputs.choice must be a list of 1 to "
                    f"{MAX_CHOICES} non-empty strings")
            _check_size("choice", sum(len(c) for c in choice))

    def key(self) -> str:
        """A canonical JSON of the constraint: equal constraints give equal keys (a
        schema's key order does not matter), so compiled grammars are cached by it."""
        kind = self.kind
        if kind is StructuredKind.JSON:
            value: Any = _parse_schema(self.json)
        elif kind is StructuredKind.JSON_OBJECT:
            value = True
        else:
            value = getattr(self, kind.value)
        return json_module.dumps([kind.value, value], sort_keys=True, separators=(",", ":"),
                                 ensure_ascii=False)

    def schema_text(self) -> str:
        """The JSON schema as a string (for `kind == JSON`)."""
        if isinstance(self.json, str):
            return self.json
        return json_module.dumps(self.json)


def validate(value: Any) -> StructuredOutputs | None:
    """`SamplingParams`' hook: None or a valid StructuredOutputs (a dict of its fields is
    accepted and converted); raises InvalidStructuredOutputsError otherwise."""
    if value is None or isinstance(value, StructuredOutputs):
        if value is not None:
            value.validate()
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise InvalidStructuredOutputsError(
                f"structured_outputs has unknown fields {sorted(unknown)}; the fields are "
                "json, regex, choice, grammar, json_object")
        return StructuredOutputs(**value)
    raise InvalidStructuredOutputsError(
        f"structured_outputs must be an object, got {type(value).__name__}")


def _parse_schema(schema: dict[str, Any] | str | None) -> Any:
    if isinstance(schema, dict):
        return schema
    if not isinstance(schema, str):
        raise InvalidStructuredOutputsError(
            "structured_outputs.json must be a JSON schema: an object or a JSON string")
    _check_size("json", len(schema))
    try:
        return json_module.loads(schema)
    except ValueError as exc:
        raise InvalidStructuredOutputsError(
            f"structured_outputs.json is not valid JSON: {exc}") from exc


def _checked(check: Any, value: Any, where: str) -> None:
    try:
        check(value, where)
    except ConstraintError as exc:
        raise InvalidStructuredOutputsError(str(exc)) from None


def _check_size(name: str, num_chars: int) -> None:
    if num_chars > MAX_SPEC_CHARS:
        raise InvalidStructuredOutputsError(
            f"structured_outputs.{name} must be at most {MAX_SPEC_CHARS} characters, got "
            f"{num_chars}")
