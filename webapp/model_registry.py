"""Served models as the web sees them: name, checkpoint, tokenizer, context length.

The web tokenizes every prompt (length checks and chat templates need the tokenizer), so
each process loads a model's tokenizer once, on first use, through `transformers`
(offline). No weights, no torch.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.gc_freeze import freeze_loaded_objects
from tasks.params import ModelLimits
from tasks.settings import Settings
from webapp.tool_calls import messages_for_template

logger = logging.getLogger(__name__)


class UnknownModelError(LookupError):
    def __init__(self, name: str, served: list[str]) -> None:
        super().__init__(f"model {name!r} is not served here; served models: "
                         f"{', '.join(served) or '(none: set LLMQ_MODELS)'}")
        self.name = name


class ModelLoadError(RuntimeError):
    """A configured model's checkpoint directory cannot be read."""


@dataclass(slots=True)
class ServedModel:
    name: str
    path: str  # checkpoint directory
    max_model_len: int  # prompt tokens + max_tokens must fit in this
    # rows of the model's embedding (config.json), the bound of every token id; NOTE: not
    # len(tokenizer): a tokenizer may have fewer tokens (padded embeddings) or more
    vocab_size: int
    tokenizer: Any  # a transformers tokenizer; thread-safe for encode/decode

    @property
    def limits(self) -> ModelLimits:
        """What every request to this model is checked against (`SamplingParams.check`)."""
        return ModelLimits(vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a completion prompt (with the model's own special tokens, e.g. BOS)."""
        return list(self.tokenizer(prompt).input_ids)

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None, *,
                    add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat: the tokenizer's chat template with the assistant cue
        (unless `add_generation_prompt` is False), and the tools (OpenAI tool objects) where
        the template puts them, or in a system section when it has no place for them
        (`webapp/tool_calls.py`).

        Raises ValueError when the model has no chat template or the template rejects the
        messages (e.g. roles out of order).
        """
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"model {self.name!r} has no chat template; send a prompt instead "
                             "of messages")
        if tools or any("tool_calls" in m or m.get("content") is None for m in messages):
            messages = messages_for_template(messages, tools, str(template))
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - template errors are Jinja's own types
            raise ValueError(f"the chat template of {self.name!r} rejected the messages: "
                             f"{exc}") from None
        return str(text)

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat (the template already holds the special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode_many(self, texts: list[str], *, chat: bool) -> list[list[int]]:
        """`encode` (or, `chat`, `encode_chat`) of every text, in one tokenizer call."""
        if not texts:
            return []
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=not chat).input_ids]


def read_max_model_len(path: str, limit: int | None = None) -> int:
    """The context length from the checkpoint's config.json, capped by `limit` if given."""
    length = _config_int(path, "max_position_embeddings")
    return min(length, limit) if limit else length


def read_vocab_size(path: str) -> int:
    """The model's vocabulary size (embedding rows) from the checkpoint's config.json."""
    return _config_int(path, "vocab_size")


def _config_int(path: str, key: str) -> int:
    """A positive integer of config.json (of its `text_config` for multimodal models)."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from None
    text_config = config.get("text_config") or config
    value = text_config.get(key) or config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{config_path} has no {key}")
    return value


class ModelRegistry:
    """The models of `settings.models`, loaded lazily and cached for the process."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._models: dict[str, ServedModel] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self._settings.models)

    def max_model_len(self, name: str) -> int:
        """Context length without loading the tokenizer (for listings)."""
        if name in self._models:
            return self._models[name].max_model_len
        return read_max_model_len(self._path(name), self._settings.max_model_len)

    def get(self, name: str) -> ServedModel:
        """Raises UnknownModelError, or ModelLoadError when the checkpoint is unreadable."""
        model = self._models.get(name)
        if model is not None:
            return model
        path = self._path(name)
        with self._lock:
            model = self._models.get(name)
            if model is None:
                model = self._load(name, path)
                self._models[name] = model
                # NOTE: loading a tokenizer imports transformers: ~300,000 objects that
                # every full collection would walk (180 ms) while the process waits
                freeze_loaded_objects()
        return model

    def preload(self) -> list[str]:
        """Load every configured model now (a server process, before it serves); returns
        the names that could not be loaded (each logged; their requests get the error as
        before).

        NOTE: loaded lazily, the first request to each web process waited for the
        tokenizer and the full collection after it (`freeze_loaded_objects`), and so did
        every request and event stream of the process behind it: with two web processes
        and a warm-up that reached only one, that stall fell into a burst of submissions.
        """
        failed = []
        for name in self.names():
            try:
                self.get(name)
            except ModelLoadError as exc:
                logger.warning("model %s not loaded at start-up: %s", name, exc)
                failed.append(name)
        return failed

    def _path(self, name: str) -> str:
        path = self._settings.models.get(name)
        if path is None:
            raise UnknownModelError(name, self.names())
        return path

    def _load(self, name: str, path: str) -> ServedModel:
        max_model_len = read_max_model_len(path, self._settings.max_model_len)
        vocab_size = read_vocab_size(path)
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types here
            raise ModelLoadError(f"cannot load the tokenizer of model {name!r} from {path}: "
                                 f"{exc}") from None
        logger.info("loaded tokenizer of model %s from %s (max_model_len %d, vocab_size %d)",
                    name, path, max_model_len, vocab_size)
        return ServedModel(name=name, path=path, max_model_len=max_model_len,
                           vocab_size=vocab_size, tokenizer=tokenizer)
