"""Checks of a constraint's text without the grammar backend, for the web process.

xgrammar imports torch (measured: `import xgrammar` loads it, ~1.8 s), and the web must
stay light (`tests/test_layers.py`), so the web cannot ask xgrammar itself. These checks
catch what the backend would refuse or, worse, silently ignore:

* JSON schema: every keyword must be one xgrammar 0.2.8 honours (or a pure annotation);
  found by compiling each keyword with and without it and comparing the grammars. Those it
  drops without a word (`allOf`, `not`, `if`/`then`/`else`, `dependentRequired`,
  `uniqueItems: true`, `contains`, unknown `format`s, remote `$ref`, ...) are refused here,
  naming the keyword and its place in the schema.
* regex: Python's parser, then the constructs xgrammar's parser refuses (lookaround,
  backreferences, word boundaries, inline flags, Unicode classes, possessive repeats).
* EBNF grammar: a `root` rule and balanced brackets and quotes. The rest (an undefined
  rule, a bad element) is found by the worker's parse, which fails the job with a 400.
"""

from __future__ import annotations

import re
from typing import Any

MAX_SCHEMA_DEPTH = 64

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "array", "object"})
# formats xgrammar turns into a grammar; any other format would be ignored
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly"})
NON_NEGATIVE_INTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                     "maxProperties")
NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_VALUES = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
                 "unevaluatedItems")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SUPPORTED = ANNOTATIONS | set(NON_NEGATIVE_INTS) | set(NUMBERS) | set(SCHEMA_MAPS) | set(
    SCHEMA_VALUES) | set(SCHEMA_LISTS) | {"type", "required", "enum", "const", "pattern",
                                          "format", "$ref", "uniqueItems"}


class ConstraintError(ValueError):
    """The constraint cannot be honoured; the message says where and why."""


def check_json_schema(schema: Any, where: str) -> None:
    """Raise ConstraintError unless every keyword of `schema` is one the grammar backend
    honours, with a value of the right type. `where` names the schema in the message."""
    _check_schema(schema, schema, where, "#", 0)


def _check_schema(node: Any, root: Any, where: str, path: str, depth: int) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ConstraintError(f"{where}: the schema at {path} must be an object or a boolean")
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"{where}: the schema nests deeper than {MAX_SCHEMA_DEPTH}")
    unknown = sorted(set(node) - SUPPORTED)
    if unknown:
        raise ConstraintError(
            f"{where}: keyword {unknown[0]!r} at {path} is not supported by the grammar "
            "backend (it would be ignored); supported: " + ", ".join(sorted(SUPPORTED)))

    def fail(keyword: str, what: str) -> ConstraintError:
        return ConstraintError(f"{where}: {keyword!r} at {path} must be {what}")

    kind = node.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
            raise fail("type", "one of " + ", ".join(sorted(JSON_TYPES)) + " or a list of them")
    for keyword in NON_NEGATIVE_INTS:
        value = node.get(keyword)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            raise fail(keyword, "an integer >= 0")
    for keyword in NUMBERS:
        value = node.get(keyword)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise fail(keyword, "a number")
    if node.get("multipleOf") is not None and node["multipleOf"] <= 0:
        raise fail("multipleOf", "a number > 0")
    required = node.get("required")
    if required is not None and not (isinstance(required, list) and all(
            isinstance(name, str) for name in required)):
        raise fail("required", "a list of property names")
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise fail("enum", "a non-empty list")
    if node.get("uniqueItems") not in (None, False):
        raise fail("uniqueItems", "false (unique items cannot be enforced while generating)")
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise fail("format", "one of " + ", ".join(sorted(FORMATS)) + " (others would be "
                   "ignored)")
    if "pattern" in node:
        if not isinstance(node["pattern"], str):
            raise fail("pattern", "a regular expression string")
        check_regex(node["pattern"], f"{where}: 'pattern' at {path}")
    if "$ref" in node:
        _check_ref(node["$ref"], root, where, path)
    for keyword in SCHEMA_MAPS:
        if keyword in node:
            value = node[keyword]
            if not isinstance(value, dict):
                raise fail(keyword, "an object of schemas")
            for name, sub in value.items():
                if keyword == "patternProperties":
                    check_regex(name, f"{where}: a 'patternProperties' key at {path}")
                _check_schema(sub, root, where, f"{path}/{keyword}/{name}", depth + 1)
    for keyword in SCHEMA_VALUES:
        if keyword in node:
            _check_schema(node[keyword], root, where, f"{path}/{keyword}", depth + 1)
    for keyword in SCHEMA_LISTS:
        if keyword in node:
            value = node[keyword]
            if not isinstance(value, list) or not value:
                raise fail(keyword, "a non-empty list of schemas")
            for i, sub in enumerate(value):
                _check_schema(sub, root, where, f"{path}/{keyword}/{i}", depth + 1)


def _check_ref(ref: Any, root: Any, where: str, path: str) -> None:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ConstraintError(f"{where}: '$ref' at {path} must point inside the schema "
                              "('#/$defs/...'); remote references are not fetched")
    target = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            raise ConstraintError(f"{where}: '$ref' at {path} points to {ref!r}, which the "
                                  "schema does not define")
        target = target[part]


# constructs Python's `re` accepts but xgrammar's regex parser refuses
_REGEX_REFUSED = (
    (re.compile(r"\(\?[=!]"), "lookahead"),
    (re.compile(r"\(\?<[=!]"), "lookbehind"),
    (re.compile(r"\(\?P"), "Python-style named groups (use (?<name>...))"),
    (re.compile(r"\(\?[aiLmsux-]"), "inline flags such as (?i)"),
    (re.compile(r"\\[1-9]"), "backreferences"),
    (re.compile(r"\\[bB]"), "word boundaries (\\b, \\B)"),
    (re.compile(r"\\[pP]\{"), "Unicode classes (\\p{...})"),
    (re.compile(r"[*+?}][+]"), "possessive repeats (a++)"),
)
_ESCAPED_PAIR = re.compile(r"\\\\")


_ECMA_NAMED_GROUP = re.compile(r"\(\?<(?![=!])")


def check_regex(pattern: str, where: str) -> None:
    """Raise ConstraintError when the grammar backend cannot parse `pattern`."""
    text = _ESCAPED_PAIR.sub("", pattern)  # "\\\\1" is a backslash then "1"
    for found, what in _REGEX_REFUSED:
        if found.search(text):
            raise ConstraintError(f"{where} uses {what}, which the grammar backend does not "
                                  "support")
    try:
        # NOTE: the backend's dialect is ECMAScript's: `(?<name>...)` is Python's `(?P<name>`
        re.compile(_ECMA_NAMED_GROUP.sub("(?P<", pattern))
    except re.error as exc:
        raise ConstraintError(f"{where} is not a valid regular expression: {exc}") from None
    except (RecursionError, OverflowError):
        raise ConstraintError(f"{where} is too complex a regular expression") from None


_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*::=", re.MULTILINE)


def check_ebnf(grammar: str, where: str) -> None:
    """Raise ConstraintError for a grammar without a `root` rule or with unbalanced
    brackets or quotes (cheap; the worker's parse checks the rest)."""
    if "root" not in _RULE.findall(grammar):
        raise ConstraintError(f"{where} has no root rule: start with `root ::= ...`")
    stack: list[str] = []
    quote: str | None = None
    i = 0
    while i < len(grammar):
        char = grammar[i]
        if quote is not None:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = None
        elif char == '"':
            quote = char
        elif char == "[":
            # a character class: up to the first unescaped "]"
            i += 1
            while i < len(grammar) and grammar[i] != "]":
                i += 2 if grammar[i] == "\\" else 1
            if i >= len(grammar):
                raise ConstraintError(f"{where}: a character class '[' is never closed")
        elif char == "(":
            stack.append(char)
        elif char == ")":
            if not stack:
                raise ConstraintError(f"{where}: ')' at offset {i} closes nothing")
            stack.pop()
        elif char == "#":  # a comment, to the end of the line
            while i < len(grammar) and grammar[i] != "\n":
                i += 1
        i += 1
    if quote is not None:
        raise ConstraintError(f"{where}: a string literal is never closed")
    if stack:
        raise ConstraintError(f"{where}: '(' is never closed")
