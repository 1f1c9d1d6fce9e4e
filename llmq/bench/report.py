"""vLLM's printed result table and result JSON (same headings, same keys)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from llmq.bench.metrics import METRIC_NAMES, BenchmarkMetrics
from llmq.bench.request_types import RequestOutput

WIDTH = 50
HEADERS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"),
           "e2el": ("E2EL", "End-to-end Latency")}
# per-request arrays, kept only with --save-detailed
DETAILED_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "latencies",
                   "generated_texts", "errors")


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9": the pXX of vLLM's keys and headings."""
    return str(int(p)) if int(p) == p else str(p)


def result_dict(metrics: BenchmarkMetrics, outputs: list[RequestOutput], output_lens: list[int],
                duration: float, goodput: dict[str, float]) -> dict[str, Any]:
    """The benchmark part of vLLM's result JSON (every metric's statistics included)."""
    result: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for name in METRIC_NAMES:
        stats = metrics.stats[name]
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    return result


def print_table(metrics: BenchmarkMetrics, duration: float, max_concurrency: int | None,
                request_rate: float, goodput: dict[str, float], shown_metrics: list[str],
                write: Callable[[str], Any] = print) -> None:
    """vLLM's `Serving Benchmark Result` table; `shown_metrics` (from
    `--percentile-metrics`) pick the latency sections."""
    def row(label: str, value: Any, fmt: str = "") -> None:
        write("{:<40} {:<10{}}".format(label, value, fmt))

    write("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="="))
    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", duration, ".2f")
    row("Total input tokens:", metrics.total_input)
    row("Total generated tokens:", metrics.total_output)
    row("Request throughput (req/s):", metrics.request_throughput, ".2f")
    if goodput:
        row("Request goodput (req/s):", metrics.request_goodput, ".2f")
    row("Output token throughput (tok/s):", metrics.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", metrics.max_concurrent_requests, ".2f")
    row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f")
    for name in METRIC_NAMES:
        if name not in shown_metrics:
            continue
        short, header = HEADERS[name]
        stats = metrics.stats[name]
        write("{s:{c}^{n}}".format(s=header, n=WIDTH, c="-"))
        row(f"Mean {short} (ms):", stats.mean, ".2f")
        row(f"Median {short} (ms):", stats.median, ".2f")
        for p, value in stats.percentiles:
            row(f"P{percentile_word(p)} {short} (ms):", value, ".2f")
    write("=" * WIDTH)
