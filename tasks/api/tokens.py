"""Bodies of vLLM's extra endpoints: `POST /tokenize`, `POST /detokenize`, `GET /version`
(the shapes vLLM's OpenAI server answers, so its tools work against llmq)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from tasks.api.fields import MAX_MESSAGES, RequestModel, Text, TokenId
from tasks.api.openai import ChatMessage


class TokenizeRequest(RequestModel):
    """Exactly one of `prompt` (tokenized as a completion prompt) or `messages` (rendered
    with the model's chat template first)."""

    model: Annotated[Text, Field(min_length=1, description="a served model (GET /v1/models)")]
    prompt: Text | None = Field(None, description="completion text")
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | \
        None = Field(None, description="a chat, rendered with the model's chat template")
    add_generation_prompt: bool | None = Field(
        None, description="messages: end with the assistant cue; default true")
    add_special_tokens: bool | None = Field(
        None, description="add the tokenizer's special tokens (e.g. BOS); default true for "
        "a prompt, false for messages (the template holds them)")


class TokenizeResponse(BaseModel):
    count: int  # len(tokens)
    max_model_len: int  # prompt + max_tokens a request to the model may have
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: Annotated[Text, Field(min_length=1, description="a served model (GET /v1/models)")]
    tokens: list[TokenId] = Field(description="token ids, each below the model's vocab_size")


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str  # the llmq package's version
