"""Per-request sampling parameters (`SamplingParams`) and the one check of them against
the served model: the API validates with them, the workers sample with them, and the
offline API re-exports them.

Plain data, no torch: the same object travels from the job schema to the sampler.

Two levels of checks, both raising `InvalidParamError` (field, value, allowed range):
* `SamplingParams.validate()` (run on construction): types and ranges that hold for any
  model;
* `SamplingParams.check(limits)`: the same plus what depends on the served model
  (`ModelLimits`: vocabulary size, context length). The web runs it before it stores a
  job and the engine again in `add_request`, so a request that passes can never make a
  batched step raise (which would fail every job sharing that step).

The numeric bounds keep every value the sampler derives finite in float32 (it casts
parameters to float32 and applies them to float32 logits):
* temperature in [0, 100]: logits are divided by it; masked logits are -inf, and
  -inf / inf is NaN, so the bound must stay far below float32's max (3.4e38). At 100 the
  distribution is already close to uniform for any real model; OpenAI allows [0, 2],
  vLLM any value >= 0. Values below 1e-5 sample greedily (the sampler's rule).
* repetition_penalty in [0.01, 2]: positive logits are divided by it, so a penalty that
  rounds to a float32 denormal or 0 (below ~1e-38) makes them inf, and the softmax NaN.
  0.01 scales a logit by at most 100; 2 is SGLang's upper bound (vLLM only asks > 0).
* presence_penalty, frequency_penalty in [-2, 2] (OpenAI): frequency is multiplied by a
  count of at most max_model_len.
* top_p in (0, 1], min_p in [0, 1] (tiny values rounding to 0 in float32 behave as the
  limits they approach); top_k in [0, vocab_size], 0 disables.
* seed in [0, 2**63 - 1] (int64), logprobs in [0, 20] (OpenAI's top_logprobs), n in
  [1, 256] (the engine builds one sequence per sample at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tasks import structured
from tasks.structured import StructuredOutputs

MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_N = 256  # samples per request, whatever the server allows (its max_n is lower)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 200
MAX_STOP_TOKEN_IDS = 128
_MAX_SHOWN_CHARS = 80  # of a rejected value in an error message


class InvalidParamError(ValueError):
    """A request parameter outside what the model or the sampler can take.

    `param` names the field (`stop_token_ids[2]` for one element of a list), `value` is
    what was given and `allowed` the allowed range, as the message reads:
    "<param> must be <allowed>, got <value>".
    """

    def __init__(self, param: str, value: Any, allowed: str) -> None:
        self.param = param
        self.value = value
        self.allowed = allowed
        super().__init__(f"{param} must be {allowed}, got {_show(value)}")


@dataclass(slots=True)
class ModelLimits:
    """What a request is checked against: the served model's sizes."""

    vocab_size: int | None  # token ids; from config.json (the embedding's rows), None: unknown
    max_model_len: int | None  # tokens; prompt + max_tokens must fit, None: unknown


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy; [0, MAX_TEMPERATURE]
    top_p: float = 1.0  # (0, 1]; 1.0 disables
    top_k: int = 0  # 0 disables; at most the vocabulary size
    min_p: float = 0.0  # [0, 1]; 0.0 disables
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # excluded from the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS / stop token ids are not honoured before this many tokens
    n: int = 1  # number of samples sharing the prompt
    presence_penalty: float = 0.0  # [-2, 2], OpenAI semantics
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI semantics
    repetition_penalty: float = 1.0  # [0.01, 2], HF/CTRL semantics over prompt and output
    logprobs: int | None = None  # top-n logprobs per sampled token; None disables
    # a constraint on the output (JSON schema, regex, choice, grammar); None: free text
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidParamError (a ValueError) naming the field and its allowed range;
        checks what holds for any model."""
        _int_in("max_tokens", self.max_tokens, 1, None)
        _int_in("min_tokens", self.min_tokens, 0, self.max_tokens,
                f"in [0, max_tokens={self.max_tokens}]")
        _int_in("n", self.n, 1, MAX_N)
        _number_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _number_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_in("top_k", self.top_k, 0, None, "an integer >= 0 (0 disables)")
        _number_in("min_p", self.min_p, 0.0, 1.0)
        _number_in("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY,
                   MAX_ABS_PENALTY)
        _number_in("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY,
                   MAX_ABS_PENALTY)
        _number_in("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                   MAX_REPETITION_PENALTY)
        if self.seed is not None:
            _int_in("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParamError("ignore_eos", self.ignore_eos, "true or false")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check_stop(self.stop)
        if not isinstance(self.stop_token_ids, list):
            raise InvalidParamError("stop_token_ids", self.stop_token_ids, "a list of token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParamError("stop_token_ids", len(self.stop_token_ids),
                                    f"at most {MAX_STOP_TOKEN_IDS} ids")
        check_token_ids(self.stop_token_ids, "stop_token_ids", None)
        self.structured_outputs = structured.validate(self.structured_outputs)

    def check(self, limits: ModelLimits) -> None:
        """`validate()`, then the checks against the served model: token ids inside the
        vocabulary, top_k and logprobs no larger than it, max_tokens within the context.

        Raises InvalidParamError. Passing means no batched step can fail because of
        these parameters.
        """
        self.validate()
        if limits.max_model_len is not None:
            _int_in("max_tokens", self.max_tokens, 1, limits.max_model_len,
                    f"in [1, {limits.max_model_len}] (the model's context length)")
        vocab_size = limits.vocab_size
        if vocab_size is None:
            return
        check_token_ids(self.stop_token_ids, "stop_token_ids", vocab_size)
        # NOTE: while short of min_tokens, the sampler masks every stop token id (and EOS):
        # they must leave tokens to sample from, or a row is all -inf (NaN probabilities).
        if len(set(self.stop_token_ids)) > vocab_size // 2:
            raise InvalidParamError("stop_token_ids", len(set(self.stop_token_ids)),
                                    f"at most {vocab_size // 2} distinct ids (half the "
                                    "vocabulary)")
        _int_in("top_k", self.top_k, 0, vocab_size,
                f"in [0, {vocab_size}] (0 disables; the vocabulary size at most)")
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, min(MAX_LOGPROBS, vocab_size))


def check_token_ids(token_ids: list[int], param: str, vocab_size: int | None) -> None:
    """Every id an int in [0, vocab_size) (just >= 0 when vocab_size is None); raises
    InvalidParamError naming `param[i]` of the first one that is not."""
    for i, token_id in enumerate(token_ids):
        # NOTE: bool is a subclass of int in Python; true is not a token id.
        ok = isinstance(token_id, int) and not isinstance(token_id, bool) and token_id >= 0
        if ok and (vocab_size is None or token_id < vocab_size):
            continue
        allowed = ("an integer token id >= 0" if vocab_size is None else
                   f"a token id in [0, {vocab_size}) (the model's vocabulary)")
        raise InvalidParamError(f"{param}[{i}]", token_id, allowed)


def _int_in(name: str, value: Any, low: int, high: int | None,
            allowed: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        raise InvalidParamError(name, value, allowed or (
            f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"))


def _number_in(name: str, value: Any, low: float, high: float, *,
               low_open: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and math.isfinite(value) and (value > low if low_open else value >= low) \
            and value <= high:
        return
    raise InvalidParamError(name, value, f"a number in {'(' if low_open else '['}{low:g}, "
                            f"{high:g}]")


def _check_stop(stop: Any) -> None:
    if not isinstance(stop, list):
        raise InvalidParamError("stop", stop, "a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidParamError("stop", len(stop), f"at most {MAX_STOP_STRINGS} strings")
    for i, text in enumerate(stop):
        if not isinstance(text, str) or not 1 <= len(text) <= MAX_STOP_STRING_CHARS:
            raise InvalidParamError(f"stop[{i}]", text,
                                    f"a string of 1 to {MAX_STOP_STRING_CHARS} characters")
        problem = text_problem(text)
        if problem is not None:
            raise InvalidParamError(f"stop[{i}]", text, f"text without {problem}")


def text_problem(text: str) -> str | None:
    """What makes `text` unusable as request text, or None.

    NUL: Postgres text cannot hold it and no tokenizer means anything by it. Lone
    surrogates (a JSON "\\ud800" not paired): not Unicode text at all, so neither UTF-8
    (tokenizers, Postgres) nor a stop-string match can take them.
    """
    if "\x00" in text:
        return "NUL (\\u0000) characters"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "unpaired surrogate code points (e.g. \\ud800)"
    return None


def _show(value: Any) -> str:
    try:
        shown = repr(value)
    except ValueError:  # an int past Python's str conversion limit
        return "an integer too large to print"
    if len(shown) > _MAX_SHOWN_CHARS:
        shown = shown[:_MAX_SHOWN_CHARS - 3] + "..."
    # NOTE: the message may be stored (Postgres) and logged: no lone surrogates in it.
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")
