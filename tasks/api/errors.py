"""The error body every endpoint answers with, and pydantic's validation errors turned
into it: one message naming the field (`messages[0].content`), never pydantic's own list.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError

from tasks.params import InvalidParamError

_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
# what a field of several shapes (a union) accepts, said once instead of per shape
UNION_SHAPES = {
    "prompt": "a string or a list of token ids (or a one-element list of either)",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
}
_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "string_type": "a string", "bool_type": "true or false", "bool_parsing": "true or false",
    "list_type": "a list", "model_type": "an object", "dict_type": "an object",
    "model_attributes_type": "an object", "datetime_type": "an ISO 8601 date-time",
    "datetime_parsing": "an ISO 8601 date-time", "datetime_from_date_parsing":
    "an ISO 8601 date-time", "uuid_parsing": "a job id (UUID)", "uuid_type": "a job id (UUID)",
}


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    type: str  # invalid_request_error, not_found_error, rate_limit_error, ...
    message: str  # what is wrong and what to do
    param: str | None = None  # the field at fault: `messages[0].content`, `Idempotency-Key`
    code: str | None = None  # machine-readable: invalid_value, job_not_found, ...


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body: `{"error": {type, message, param, code}}`."""

    error: ErrorDetail


class SchemaError(ValueError):
    """A request field is missing, of the wrong type or out of range."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    @classmethod
    def from_invalid_param(cls, exc: InvalidParamError) -> SchemaError:
        """The request field of a parameter error (`stop_token_ids[3]` is field
        `stop_token_ids`; the message keeps the element)."""
        return cls(str(exc), exc.param.split("[", 1)[0])

    @classmethod
    def from_validation(cls, exc: ValidationError, model: type[BaseModel] | None = None,
                        body: Any = None) -> SchemaError:
        """The first problem of a pydantic validation: `param` the field's path
        (`messages[0].role`), the message `<param> must be <what>, got <value>`. `body`:
        the value validated, when the caller has it (a tagged union's tag is then left
        out of the path, `_without_tags`)."""
        errors = exc.errors()
        error = errors[0]
        loc = tuple(error["loc"])
        refused = _refused_content(errors)
        if refused is not None:
            error, loc = refused, tuple(p for p in refused["loc"] if _is_path_part(p))
        if body is not None:
            loc = _without_tags(loc, body)
        if error["type"] in ("union_tag_invalid", "union_tag_not_found"):  # the tag's field
            loc += (_tag_key(error.get("ctx") or {}),)
        path, whole = _param(loc)
        result = cls._describe(error, loc, path, whole, model)
        # NOTE: like InvalidParamError's: the message names the element (`stop[2]`), the
        # param the request field (`stop`); an index into a list of objects stays
        # (`messages[0].content`).
        result.param = _field_of(path) or None
        return result

    @classmethod
    def _describe(cls, error: Any, loc: tuple[Any, ...], param: str, whole: bool,
                  model: type[BaseModel] | None) -> SchemaError:
        kind = error["type"]
        value = error.get("input")
        ctx = error.get("ctx") or {}
        if not whole:  # a union: every shape failed
            shape = UNION_SHAPES.get(str(param).rsplit(".", 1)[-1].split("[")[0])
            if shape is not None:
                return cls(f"{param} must be {shape}", param)
        if kind in ("missing", "union_tag_not_found") or (kind == "string_type"
                                                          and value is None):
            return cls(f"{param} is required", param)
        if kind == "extra_forbidden":
            name = str(loc[-1])
            allowed = ""
            if model is not None and len(loc) == 1:
                allowed = "; allowed fields: " + ", ".join(sorted(model.model_fields))
            return cls(f"unknown field {name!r}{allowed}", name if len(loc) == 1 else param)
        if kind in _EXPECTED:
            # a number of the wrong kind (1e9 for an integer, an infinity) is shown itself
            got = _show(value) if isinstance(value, float) else _json_type(value)
            return cls(f"{param} must be {_EXPECTED[kind]}, got {got}", param)
        if kind == "union_tag_invalid":
            # NOTE: pydantic's ctx has the tag as text ('None' for null): the body's own
            # value is shown when it is there, its JSON type when it is not text
            tag_key = _tag_key(ctx)
            tag = value[tag_key] if isinstance(value, dict) and tag_key in value \
                else ctx.get("tag")
            return cls(f"{param} must be one of {ctx.get('expected_tags')}, got "
                       f"{_shown(tag)}", param)
        if kind == "literal_error":
            return cls(f"{param} must be {ctx.get('expected')}, got {_shown(value)}", param)
        if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
            sign = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
                    "less_than": "<"}[kind]
            bound = next(iter(ctx.values()))
            return cls(f"{param} must be {sign} {bound}, got {_show(value)}", param)
        if kind == "too_short":
            return cls(f"{param} must not be empty" if ctx.get("min_length") == 1 else
                       f"{param} must hold at least {ctx.get('min_length')} items", param)
        if kind == "too_long":
            return cls(f"{param} must hold at most {ctx.get('max_length')} items", param)
        if kind == "value_error":
            cause = ctx.get("error")
            if isinstance(cause, InvalidParamError):
                return cls.from_invalid_param(cause)
            return cls(f"{param} {cause}", param)
        return cls(f"{param}: {error['msg']}", param)


def _field_of(path: str) -> str:
    """`stop_token_ids[0]` -> `stop_token_ids`, `prompt[0][1]` -> `prompt`;
    `messages[0].content` stays."""
    return re.sub(r"(\[\d+\])+$", "", path)


def _is_path_part(part: Any) -> bool:
    """A field name or an index, not a union's shape tag (`list[int]`, `str`)."""
    return isinstance(part, int) or (isinstance(part, str) and bool(_NAME.match(part))
                                     and part not in ("str", "int", "list", "float"))


def _param(loc: tuple[Any, ...]) -> tuple[str, bool]:
    """(`messages[0].content`, whether the whole path was field names and indexes; a
    union's shape tag such as `list[int]` ends it)."""
    param = ""
    for part in loc:
        if not _is_path_part(part):
            return param, False
        param += f"[{part}]" if isinstance(part, int) else ("." if param else "") + part
    return param, True


def _refused_content(errors: list[Any]) -> Any | None:
    """When every shape of a union failed (the first error's path ends in a shape tag),
    the error of a shape that took the value's type and refused what it holds (a prompt
    string with a NUL in it, a token id below 0, a content part of another type): it says
    what is wrong, where the other shapes' errors only say the type differs. None
    otherwise, and when every shape refused the type itself (the shapes are said)."""
    path, whole = _param(tuple(errors[0]["loc"]))
    # NOTE: an unknown key is not a shape tag, whatever its name ("", "a-b"); a union is
    # a field's: its path names it
    if whole or not path or errors[0]["type"] == "extra_forbidden":
        return None
    return next((error for error in errors if not _type_mismatch(error["type"])
                 and _param(tuple(error["loc"])) == (path, False)), None)


def _tag_key(ctx: dict[str, Any]) -> str:
    """The key of a tagged union's tag, from its error's ctx (pydantic quotes it)."""
    return str(ctx.get("discriminator", "type")).strip("'")


def _type_mismatch(kind: str) -> bool:
    return kind.endswith(("_type", "_parsing")) or kind == "int_from_float"


def _without_tags(loc: tuple[Any, ...], body: Any) -> tuple[Any, ...]:
    """`loc` without the tags of tagged unions: pydantic puts the tag (the object's
    `type`) in the path, `response_format.json_schema.json_schema` for a missing
    `json_schema`. Walked through the `body` validated: a part that is its object's
    `type` is a tag where reading it as a key does not reach the rest of the path."""
    kept: list[Any] = []
    value = body
    for index, part in enumerate(loc):
        rest = loc[index + 1:]
        if (isinstance(value, dict) and isinstance(part, str) and rest
                and value.get("type") == part and not _reaches(value.get(part), rest)):
            continue  # a tag: the rest of the path is read in this same object
        kept.append(part)
        value = _step(value, part)
    return tuple(kept)


def _step(value: Any, part: Any) -> Any:
    if isinstance(value, dict) and isinstance(part, str):
        return value.get(part)
    if isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
        return value[part]
    return None


def _reaches(value: Any, rest: tuple[Any, ...]) -> bool:
    """Whether `rest` (a path below `value`) can be read in it: each part a key or index
    that is there, but for the last, which may be a missing field."""
    for index, part in enumerate(rest):
        last = index == len(rest) - 1
        if isinstance(value, dict) and isinstance(part, str):
            if part not in value:
                return last
        elif not (isinstance(value, list) and isinstance(part, int)
                  and 0 <= part < len(value)):
            return False
        value = _step(value, part)
    return True


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _shown(value: Any) -> str:
    """A refused value as the client sent it: text and numbers themselves, anything else
    by its JSON type (`null`, not Python's `None`)."""
    if isinstance(value, str) or (isinstance(value, int | float) and not isinstance(value, bool)):
        return _show(value)
    return _json_type(value)


def _show(value: Any) -> str:
    return str(InvalidParamError("x", value, "y")).split(", got ", 1)[1]
