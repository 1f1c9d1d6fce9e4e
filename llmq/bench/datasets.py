"""The benchmark's requests: vLLM's `random`, `prefix_repetition`, `sharegpt` and `custom`
datasets, built from a `PromptVocabulary` (exact token ids or calibrated words)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmq.bench.prompts import PromptVocabulary

logger = logging.getLogger(__name__)

DATASETS = ("random", "prefix_repetition", "sharegpt", "custom")
# ShareGPT filters, as vLLM applies them (tokens)
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens (estimated without --tokenizer)
    expected_output_len: int  # max tokens to generate


def sample_random(vocab: PromptVocabulary, rng: np.random.Generator, num_requests: int,
                  input_len: int, output_len: int, range_ratio: float,
                  prefix_len: int) -> list[SampleRequest]:
    """Random prompts: one fixed prefix of `prefix_len` tokens, then a random part whose
    length, like the output length, is uniform in [len*(1-r), len*(1+r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    in_low, in_high = math.floor(input_len * (1 - range_ratio)), math.ceil(
        input_len * (1 + range_ratio))
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_low < 1:
        raise ValueError("--random-input-len is too small: every prompt needs at least one "
                         "token (raise --random-input-len or --random-prefix-len)")
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    prefix = vocab.sample(prefix_len, rng)
    requests = []
    for i in range(num_requests):
        text, length = vocab.render([prefix, vocab.sample(int(input_lens[i]), rng)], rng)
        requests.append(SampleRequest(text, length, int(output_lens[i])))
    return requests


def sample_prefix_repetition(vocab: PromptVocabulary, rng: np.random.Generator,
                             num_requests: int, prefix_len: int, suffix_len: int,
                             num_prefixes: int, output_len: int) -> list[SampleRequest]:
    """`num_prefixes` random prefixes, each shared by an equal share of the prompts (each
    with its own random suffix), shuffled.

    NOTE: vLLM sends `num_prefixes * (num_prompts // num_prefixes)` prompts; here the
    remainder is spread over the first prefixes so exactly `num_prompts` are sent.
    """
    if num_prefixes < 1 or num_requests < num_prefixes:
        raise ValueError(f"--num-prompts ({num_requests}) must be at least "
                         f"--prefix-repetition-num-prefixes ({num_prefixes}), which must be >= 1")
    requests = []
    for p in range(num_prefixes):
        prefix = vocab.sample(prefix_len, rng)
        share = num_requests // num_prefixes + (1 if p < num_requests % num_prefixes else 0)
        for _ in range(share):
            text, length = vocab.render([prefix, vocab.sample(suffix_len, rng)], rng)
            requests.append(SampleRequest(text, length, output_len))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def sample_sharegpt(vocab: PromptVocabulary, rng: np.random.Generator, num_requests: int,
                    path: str, output_len: int | None) -> list[SampleRequest]:
    """The first turn of each ShareGPT conversation as the prompt; the second turn's
    length as the output length (unless `--sharegpt-output-len`)."""
    conversations = [entry["conversations"] for entry in _load_json_records(path)
                     if len(entry.get("conversations") or []) >= 2]
    requests: list[SampleRequest] = []
    for i in rng.permutation(len(conversations)):
        if len(requests) == num_requests:
            break
        prompt = conversations[i][0]["value"]
        prompt_len = vocab.count(prompt)
        out_len = output_len if output_len is not None else vocab.count(
            conversations[i][1]["value"])
        if (prompt_len < SHAREGPT_MIN_LEN
                or (output_len is None and out_len < SHAREGPT_MIN_LEN)
                or prompt_len > SHAREGPT_MAX_PROMPT_LEN
                or prompt_len + out_len > SHAREGPT_MAX_TOTAL_LEN):
            continue
        requests.append(SampleRequest(prompt, prompt_len, out_len))
    return _oversample(requests, num_requests, path)


def sample_custom(vocab: PromptVocabulary, rng: np.random.Generator, num_requests: int,
                  path: str, output_len: int) -> list[SampleRequest]:
    """A JSONL file, one object with a `prompt` field per line, in file order."""
    records = _load_json_records(path)
    missing = [n for n, record in enumerate(records, 1) if "prompt" not in record]
    if missing:
        raise ValueError(f"{path}: record {missing[0]} has no \"prompt\" field (the custom "
                         "dataset is JSONL: one {\"prompt\": ...} object per line)")
    requests = [SampleRequest(r["prompt"], vocab.count(r["prompt"]), output_len)
                for r in records[:num_requests]]
    return _oversample(requests, num_requests, path)


def get_samples(args: Any, vocab: PromptVocabulary) -> list[SampleRequest]:
    """The requests `args` (the `llmq bench` flags) ask for, seeded by `--seed`."""
    rng = np.random.default_rng(args.seed)
    name = args.dataset_name
    if name in ("sharegpt", "custom") and not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path (a local file)")
    if name in ("random", "prefix_repetition") and args.dataset_path:
        raise ValueError(f"--dataset-name {name} is synthetic and takes no --dataset-path; "
                         "use sharegpt or custom for a file")
    if name == "random":
        return sample_random(vocab, rng, args.num_prompts, args.random_input_len,
                             args.random_output_len, args.random_range_ratio,
                             args.random_prefix_len)
    if name == "prefix_repetition":
        return sample_prefix_repetition(
            vocab, rng, args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len)
    if name == "sharegpt":
        return sample_sharegpt(vocab, rng, args.num_prompts, args.dataset_path,
                               args.sharegpt_output_len)
    if name == "custom":
        return sample_custom(vocab, rng, args.num_prompts, args.dataset_path,
                             args.custom_output_len)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def _load_json_records(path: str) -> list[dict[str, Any]]:
    """A JSON array of objects, or JSONL (one object per line)."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        return list(json.loads(stripped))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _oversample(requests: list[SampleRequest], num_requests: int,
                path: str) -> list[SampleRequest]:
    if not requests:
        raise ValueError(f"{path}: no usable prompts in the file")
    if len(requests) < num_requests:
        logger.warning("%s has %d usable prompts for --num-prompts %d: repeating them",
                       path, len(requests), num_requests)
        requests = [requests[i % len(requests)] for i in range(num_requests)]
    return requests
