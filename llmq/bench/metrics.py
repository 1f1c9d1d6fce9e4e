"""vLLM's serving metrics from the per-request outputs.

TPOT = (E2EL - TTFT) / (output tokens - 1), for requests of more than one output token.
Goodput counts requests within every SLO given (`--goodput ttft:MS tpot:MS e2el:MS`;
a request of one token has TPOT 0 there). Peak output throughput counts content chunks
per 1 s bucket from the first request's start; peak concurrency is the most requests in
flight at once (half-open [start, end) intervals).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from llmq.bench.request_types import RequestOutput

logger = logging.getLogger(__name__)

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class MetricStats:
    """Milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (percentile, value)

    @classmethod
    def of(cls, seconds: list[float], percentiles: list[float]) -> MetricStats:
        values = np.asarray(seconds or [0.0]) * 1000.0
        return cls(float(np.mean(values)), float(np.median(values)), float(np.std(values)),
                   [(p, float(np.percentile(values, p))) for p in percentiles])


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int  # tokens of the completed requests
    total_output: int
    request_throughput: float  # req/s
    request_goodput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # tok/s
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, MetricStats] = field(default_factory=dict)  # by METRIC_NAMES


def output_len(output: RequestOutput) -> int:
    """Tokens generated: the server's usage, else the number of content chunks."""
    return output.output_tokens or output.num_chunks


def calculate_metrics(outputs: list[RequestOutput], duration: float, percentiles: list[float],
                      goodput: dict[str, float]) -> tuple[BenchmarkMetrics, list[int]]:
    """The metrics of a run of `duration` seconds, and each request's output length
    (0 for a failed one)."""
    output_lens = [output_len(o) if o.success else 0 for o in outputs]
    done = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in done]
    e2els = [o.latency for o in done]
    itls = [gap for o in done for gap in o.itl]
    all_tpots = [(o.latency - o.ttft) / (output_len(o) - 1) if output_len(o) > 1 else 0.0
                 for o in done]
    tpots = [t for o, t in zip(done, all_tpots) if output_len(o) > 1]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(output_lens)

    good = 0
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        limits = [(per_metric[name], slo_ms / 1000.0) for name, slo_ms in goodput.items()]
        good = sum(all(values[i] <= slo for values, slo in limits) for i in range(len(done)))
    if not done:
        logger.warning("all requests failed: check the benchmark's arguments and the server")

    metrics = BenchmarkMetrics(
        completed=len(done), failed=len(outputs) - len(done), total_input=total_input,
        total_output=total_output, request_throughput=len(done) / duration,
        request_goodput=good / duration, output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=_peak_chunks_per_second(done),
        max_concurrent_requests=_peak_concurrency(done),
        stats={"ttft": MetricStats.of(ttfts, percentiles),
               "tpot": MetricStats.of(tpots, percentiles),
               "itl": MetricStats.of(itls, percentiles),
               "e2el": MetricStats.of(e2els, percentiles)})
    return metrics, output_lens


def _peak_chunks_per_second(done: list[RequestOutput]) -> float:
    if not done:
        return 0.0
    start = min(o.start_time for o in done)
    end = max(o.start_time + o.latency for o in done)
    buckets = np.zeros(int(math.ceil(end - start)) + 1)
    for o in done:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for stamp in times:
            bucket = int(stamp - start)
            if 0 <= bucket < len(buckets):
                buckets[bucket] += 1
    return float(buckets.max())


def _peak_concurrency(done: list[RequestOutput]) -> int:
    # NOTE: an end sorts before a start at the same instant: [start, end) intervals
    events = sorted([(o.start_time, 1) for o in done]
                    + [(o.start_time + o.latency, -1) for o in done])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
