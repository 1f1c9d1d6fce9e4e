"""vLLM's extra endpoints: `POST /tokenize`, `POST /detokenize` and `GET /version`, over the
served models' tokenizers (the same ones that tokenize jobs)."""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from flask import Blueprint, Response, jsonify
from pydantic import BaseModel

from tasks.api.errors import SchemaError
from tasks.api.tokens import DetokenizeRequest, TokenizeRequest
from tasks.schema import validate_body
from webapp.auth import current_api_key_id
from webapp.errors import APIError
from webapp.groups import context_len
from webapp.jobs import json_body, served_model

bp = Blueprint("tokens", __name__)


@bp.post("/tokenize")
def tokenize() -> Response:
    """A prompt's or a chat's token ids, as a job of the same request would have them."""
    current_api_key_id()
    req = _parse(TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "invalid_value", "give exactly one of prompt or messages",
                       "prompt" if req.prompt is not None else "messages")
    model = served_model(req.model)
    if req.messages is not None:
        messages = [_flat_message(message) for message in req.messages]
        try:
            text = model.render_chat(messages, add_generation_prompt=(
                req.add_generation_prompt is not False))
        except ValueError as exc:
            raise APIError(400, "invalid_messages", str(exc), "messages") from None
        add_special_tokens = bool(req.add_special_tokens)
    else:
        text = req.prompt or ""
        add_special_tokens = req.add_special_tokens is not False
    tokens = list(model.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    return jsonify({"count": len(tokens), "max_model_len": context_len(model),
                    "tokens": tokens})


@bp.post("/detokenize")
def detokenize() -> Response:
    """The text of token ids; every id must be below the model's vocab_size."""
    current_api_key_id()
    req = _parse(DetokenizeRequest)
    model = served_model(req.model)
    for i, token_id in enumerate(req.tokens):
        if token_id >= model.vocab_size:
            raise APIError(400, "invalid_value", f"tokens[{i}] must be a token id below "
                           f"{model.vocab_size} (the vocab_size of {model.name!r}), got "
                           f"{token_id}", "tokens")
    return jsonify({"prompt": model.tokenizer.decode(req.tokens)})


@bp.get("/version")
def version() -> Response:
    """The llmq package's version."""
    return jsonify({"version": package_version()})


@functools.cache  # NOTE: reading the package metadata costs ~0.5 ms
def package_version() -> str:
    try:
        return importlib.metadata.version("llmq")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0+unknown"


def _parse(model: type[BaseModel]) -> Any:
    try:
        return validate_body(model, json_body())
    except SchemaError as exc:
        raise APIError(400, "invalid_value", exc.message, exc.param) from None


def _flat_message(message: Any) -> dict[str, str]:
    """A chat message as the chat template takes it (content parts joined)."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    item = {"role": message.role, "content": content}
    if message.name is not None:
        item["name"] = message.name
    return item
