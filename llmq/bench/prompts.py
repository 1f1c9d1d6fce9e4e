"""Synthetic prompt text of a wanted length in tokens, with or without a tokenizer.

With `--tokenizer DIR` (a local Hugging Face tokenizer) prompts are random token ids,
decoded and re-encoded until the text is exactly the wanted number of tokens, as vLLM
builds them. Without one the client cannot know the server's tokenizer (it loads nothing
of the server), so prompts are random common English words: two probe requests measure
how many tokens the server counts per word (`usage.prompt_tokens` of 32 and 512 words;
the difference cancels a chat template's fixed overhead), and word counts are scaled to
hit the wanted lengths on average. Either way the input tokens reported are the server's
own `usage.prompt_tokens`.

NOTE: words rather than token ids, because a token-id prompt cannot be sent to a chat
endpoint and random ids need the vocabulary's size and special ids, which the
OpenAI API does not expose. Words separated by spaces also keep a shared prefix a shared
token prefix (BPE pre-tokenizers split at spaces), which prefix_repetition relies on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from llmq.bench.request_types import RequestOutput

logger = logging.getLogger(__name__)

CALIBRATION_WORDS = (32, 512)  # prompt lengths in words of the two probe requests
MAX_FIX_ROUNDS = 10  # decode/re-encode rounds to reach an exact token length

WORDS = """the of and to in is was for on that with as by at from his it an were are
which this be or has had first one their its new after who they two her she been other
when there all during into school time may years more most only over city some world would
where later up such used many can state about national out known university united then
made long river town house water light road morning night small great old little good day
year people way back work part place case week company number group problem fact hand eye
life child woman man home story book word name music game line end point side head power
market paper table door garden window field letter street friend summer winter spring
autumn bread stone bridge hill tree bird boat train ship horse dog cat fish apple""".split()


class PromptVocabulary(Protocol):
    """Builds synthetic prompts: random pieces of a length in tokens, joined to text."""

    name: str

    def sample(self, num_tokens: int, rng: np.random.Generator) -> list[Any]:
        """A random piece about `num_tokens` tokens long (ids or words)."""
        ...

    def render(self, pieces: list[list[Any]], rng: np.random.Generator) -> tuple[str, int]:
        """The pieces joined as prompt text, and its length in tokens (exact or estimated)."""
        ...

    def count(self, text: str) -> int:
        """Tokens in `text` (exact with a tokenizer, estimated without)."""
        ...


class TokenizerVocabulary:
    """Random token ids of a local tokenizer, exact to the token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.name = str(getattr(tokenizer, "name_or_path", "tokenizer"))
        special = set(tokenizer.all_special_ids)
        self._allowed = np.array([i for i in range(tokenizer.vocab_size) if i not in special])

    @classmethod
    def load(cls, path: str) -> TokenizerVocabulary:
        from transformers import AutoTokenizer  # only with --tokenizer: it is slow to import

        return cls(AutoTokenizer.from_pretrained(path))

    def sample(self, num_tokens: int, rng: np.random.Generator) -> list[int]:
        return self._allowed[rng.integers(0, len(self._allowed), size=num_tokens)].tolist()

    def render(self, pieces: list[list[int]], rng: np.random.Generator) -> tuple[str, int]:
        ids = [token for piece in pieces for token in piece]
        target = len(ids)
        text = self.tokenizer.decode(ids)
        # NOTE: decoding then encoding may merge or split tokens; trim or extend the ids
        # and decode again until the text re-encodes to the wanted length (vLLM does so).
        for _ in range(MAX_FIX_ROUNDS):
            encoded = self._encode(text)
            if len(encoded) == target:
                break
            if len(encoded) > target:
                ids = encoded[:target]
            else:
                ids = encoded + self.sample(target - len(encoded), rng)
            text = self.tokenizer.decode(ids)
        return text, self.count(text)

    def count(self, text: str) -> int:
        return len(self._encode(text))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


class WordVocabulary:
    """Random common words, scaled by the server's measured tokens per word."""

    name = "words"

    def __init__(self, tokens_per_word: float) -> None:
        if tokens_per_word <= 0:
            raise ValueError(f"tokens per word must be positive, got {tokens_per_word}")
        self.tokens_per_word = tokens_per_word

    def sample(self, num_tokens: int, rng: np.random.Generator) -> list[str]:
        if num_tokens <= 0:
            return []
        num_words = max(1, round(num_tokens / self.tokens_per_word))
        return [WORDS[i] for i in rng.integers(0, len(WORDS), size=num_words)]

    def render(self, pieces: list[list[str]], rng: np.random.Generator) -> tuple[str, int]:
        words = [word for piece in pieces for word in piece]
        return " ".join(words), self._estimate(len(words))

    def count(self, text: str) -> int:
        return self._estimate(len(text.split()))

    def _estimate(self, num_words: int) -> int:
        return max(1, round(num_words * self.tokens_per_word)) if num_words else 0


def calibrate_words(send: Callable[[str], RequestOutput]) -> WordVocabulary:
    """Measure the server's tokens per word with two probe prompts (one output token each).

    `send(prompt)` runs one request through the benchmark's own backend, so a chat
    endpoint's template is inside both counts and cancels in the difference.
    """
    rng = np.random.default_rng(12345)
    counts = []
    for num_words in CALIBRATION_WORDS:
        prompt = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=num_words))
        output = send(prompt)
        # NOTE: only the usage matters here; the one token may be EOS or decode to nothing
        if output.prompt_len <= 0:
            raise ValueError("the probe request that measures the server's tokens per word "
                             f"failed: {output.error or 'no error text'} (check --base-url, "
                             "--endpoint, --backend and --model, or pass --tokenizer DIR)")
        counts.append(output.prompt_len)
    spread = CALIBRATION_WORDS[1] - CALIBRATION_WORDS[0]
    tokens_per_word = (counts[1] - counts[0]) / spread
    if tokens_per_word <= 0:
        raise ValueError(f"the server reported {counts[0]} and {counts[1]} prompt tokens for "
                         f"prompts of {CALIBRATION_WORDS[0]} and {CALIBRATION_WORDS[1]} words: "
                         "it does not return usage.prompt_tokens; pass --tokenizer DIR")
    logger.info("server counts %.3f tokens per word (probe prompts: %s tokens)",
                tokens_per_word, counts)
    return WordVocabulary(tokens_per_word)
