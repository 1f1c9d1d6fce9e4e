"""The web's checks of a constraint without the grammar backend (tasks/structured_check.py):
what xgrammar would refuse or silently ignore is refused, naming the place."""

from __future__ import annotations

import pytest

from tasks.structured import InvalidStructuredOutputsError, StructuredOutputs

SUPPORTED_SCHEMA = {
    "title": "Person", "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8, "pattern": "^[a-z]+$"},
        "age": {"type": ["integer", "null"], "minimum": 0, "exclusiveMaximum": 150},
        "mail": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
        "kind": {"anyOf": [{"const": "a"}, {"enum": ["b", "c"]}]},
    },
    "required": ["name"], "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "description": "a tag"}},
}


def test_supported_schema_passes() -> None:
    StructuredOutputs(json=SUPPORTED_SCHEMA)


@pytest.mark.parametrize(("schema", "message"), [
    ({"allOf": [{"type": "object"}]}, "keyword 'allOf' at # is not supported"),
    ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}},
     "keyword 'not' at #/properties/x"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "keyword 'if'"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at # must be false"),
    ({"type": "array", "contains": {"type": "integer"}}, "keyword 'contains'"),
    ({"type": "string", "format": "idn-email"}, "'format' at # must be one of"),
    ({"$ref": "https://example.com/s.json"}, "remote references"),
    ({"$ref": "#/$defs/missing"}, "does not define"),
    ({"type": "strin"}, "'type' at # must be one of"),
    ({"type": "string", "pattern": "(?=a)"}, "lookahead"),
    ({"type": "object", "x-custom": 1}, "keyword 'x-custom'"),
    ({"type": "string", "minLength": -1}, "'minLength' at # must be an integer >= 0"),
])
def test_unsupported_or_bad_schemas_are_refused(schema: dict, message: str) -> None:
    with pytest.raises(InvalidStructuredOutputsError, match=message.replace("(", r"\(")
                       .replace(")", r"\)").replace("$", r"\$").replace("?", r"\?")):
        StructuredOutputs(json=schema)


@pytest.mark.parametrize(("regex", "message"), [
    ("[a-z", "not a valid regular expression"), ("a(?=b)", "lookahead"),
    ("(?<!a)b", "lookbehind"), (r"(a)\1", "backreferences"), (r"\bword", "word boundaries"),
    ("(?i)abc", "inline flags"), (r"\p{L}", "Unicode classes"), ("a++", "possessive"),
])
def test_regexes_the_backend_cannot_parse_are_refused(regex: str, message: str) -> None:
    with pytest.raises(InvalidStructuredOutputsError, match=message):
        StructuredOutputs(regex=regex)


def test_regexes_the_backend_parses_pass() -> None:
    for regex in [r"[a-z]{2,6}-\d{3}(\.[A-Z]{1,3})?", r"(?<year>\d{4})", r"\\1", "a|b*?"]:
        StructuredOutputs(regex=regex)


@pytest.mark.parametrize(("grammar", "message"), [
    ('start ::= "a"', "no root rule"), ('root ::= ("a"', r"'\(' is never closed"),
    ('root ::= "a', "never closed"), ("root ::= [a-z", "never closed"),
    ('root ::= "a")', "closes nothing"),
])
def test_malformed_grammars_are_refused(grammar: str, message: str) -> None:
    with pytest.raises(InvalidStructuredOutputsError, match=message):
        StructuredOutputs(grammar=grammar)


def test_well_formed_grammar_passes() -> None:
    StructuredOutputs(grammar='root ::= item ("," item)*  # a list\nitem ::= [a-z)]+ | "(\\")"')
