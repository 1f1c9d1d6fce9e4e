"""The flags of `llmq bench`: vLLM's `vllm bench serve` flag names and defaults.

Kept free of heavy imports: `llmq bench --help` builds this parser and nothing else.
"""

from __future__ import annotations

import argparse
import os

BACKENDS = ("openai", "openai-chat", "llmq-jobs")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value) if sep else float("nan")
        except ValueError:
            slos[name] = float("nan")
        if slos[name] != slos[name]:  # NaN: not a number
            raise ValueError(f"--goodput {pair!r}: give KEY:VALUE pairs like ttft:500, the "
                             "value in milliseconds")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: the metric must be one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the value must not be negative")
    return slos


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Every `llmq bench` flag, on `parser`."""
    target = parser.add_argument_group("server")
    target.add_argument("--backend", default="openai", choices=BACKENDS,
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions; "
                        "llmq-jobs: POST /v1/jobs then its SSE events (the durable path)")
    target.add_argument("--base-url", default=None,
                        help="server base URL, e.g. http://127.0.0.1:8000 (else --host/--port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--endpoint", default=None,
                        help="API path (default by backend: /v1/completions, "
                        "/v1/chat/completions, /v1/jobs)")
    target.add_argument("--model", default=None,
                        help="served model name (default: the first of /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY")
                        or os.environ.get("LLMQ_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY or $LLMQ_API_KEY)")
    target.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a local Hugging Face tokenizer directory: prompts of exact token "
                        "lengths. Without it prompts are words, scaled by the tokens per word "
                        "the server reports for two probe prompts")

    data = parser.add_argument_group("dataset")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--num-prompts", type=int, default=1000, help="number of prompts to send")
    data.add_argument("--dataset-name", default="random",
                      choices=["random", "prefix_repetition", "sharegpt", "custom"])
    data.add_argument("--dataset-path", default=None,
                      help="a local ShareGPT JSON/JSONL file, or a custom JSONL file with a "
                      "\"prompt\" field per line")
    data.add_argument("--input-len", type=int, default=None,
                      help="shorthand for --random-input-len")
    data.add_argument("--output-len", type=int, default=None,
                      help="sets every dataset's output length")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)], r in [0, 1)")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="tokens of one fixed prefix before every random prompt")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="output length of every ShareGPT request (default: its answer's)")
    data.add_argument("--custom-output-len", type=int, default=256)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second (Poisson, or gamma with --burstiness); inf "
                      "sends them all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps between requests: 1 is Poisson, < 1 "
                      "burstier, > 1 more even")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="requests sent (and not measured) before the run")
    load.add_argument("--ignore-eos", action="store_true",
                      help="generate the full output length (always on for --dataset-name "
                      "random, as in vLLM)")
    load.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    sampling = parser.add_argument_group("sampling parameters")
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)

    out = parser.add_argument_group("results")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                     help="comma-separated metrics whose percentiles are printed: ttft, "
                     "tpot, itl, e2el (the JSON has all four)")
    out.add_argument("--metric-percentiles", default="99",
                     help="comma-separated percentiles, e.g. 25,50,75,99")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    out.add_argument("--save-result", action="store_true", help="write the result JSON")
    out.add_argument("--save-detailed", action="store_true",
                     help="include per-request arrays (input_lens, ttfts, itls, ...)")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None,
                     help="default: {label}-{request_rate}qps[-concurrency{N}]-{model}-"
                     "{date}.json")
    out.add_argument("--label", default=None, help="result name prefix (default: --backend)")
