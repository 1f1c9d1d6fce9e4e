"""Service figures kept in Redis, so every web process renders the same numbers.

The figures live in the device-group workers, but `/metrics` is served by any of several
web processes. So workers record into Redis and the web reads it back:

* counters and histograms: one hash per model, `<prefix>:metrics:<model>`, every field
  grown with HINCRBY / HINCRBYFLOAT. A histogram keeps one field per bucket holding the
  count of observations that fell in that bucket (not cumulative: one HINCRBY per
  observation); the web accumulates them into Prometheus' `le` buckets.
* gauges (requests running and waiting, KV cache usage): the group heartbeats
  (`<prefix>:groups:<model>`), which already carry them.

A worker never waits on Redis for a figure: the batcher adds observations to a
`WorkerMetrics` buffer (no I/O) and the heartbeat thread folds the buffer into its own
pipeline every beat. A worker killed with -9 loses at most one heartbeat interval of
figures.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from tasks.settings import Settings

logger = logging.getLogger(__name__)

# Bucket upper bounds in seconds (the +Inf bucket is implicit), close to vLLM's.
HISTOGRAM_BUCKETS: dict[str, tuple[float, ...]] = {
    "queue_time": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0),
    "time_to_first_token": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                            0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "inter_token_latency": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                            1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "e2e_request_latency": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
}
# Counters the engine keeps cumulatively (per group lifetime); the heartbeat records
# their growth since its previous beat.
ENGINE_COUNTERS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                   "num_interrupted_steps")
JOB_STATUS_FIELD = "jobs:"  # + terminal status: jobs by terminal status
# KV tier counters (per tier, cumulative in the heartbeat's "kv_tiers"): figure -> help.
# Field `kv_tier:<figure>:<tier name>`; `_seconds` figures are float sums.
KV_TIER_FIGURES: dict[str, str] = {
    "lookups": "Prefix lookups sent to the KV tier (one round trip each).",
    "lookup_errors": "KV tier lookups that failed (counted as misses).",
    "hit_blocks": "KV blocks loaded from the tier instead of computed.",
    "loaded_bytes": "KV payload bytes loaded from the tier.",
    "load_seconds": "Seconds spent in KV tier lookups (round trip and checks).",
    "bad_blobs": "KV tier blobs refused by the format check (counted as misses).",
    "stored_blocks": "KV blocks written to the tier.",
    "stored_bytes": "KV payload bytes written to the tier.",
    "store_errors": "KV blocks whose write to the tier failed.",
}
KV_TIER_FIELD = "kv_tier:"


def kv_tier_field(figure: str, tier: str) -> str:
    """Hash field of one tier's counter (the tier name may hold colons: it comes last)."""
    return f"{KV_TIER_FIELD}{figure}:{tier}"


def metrics_key(settings: Settings, model: str) -> str:
    """Hash of a model's counters and histogram buckets."""
    return settings.key("metrics", model)


def bucket_field(histogram: str, index: int) -> str:
    """Field of bucket `index` (== len(bounds) for +Inf)."""
    return f"{histogram}:b{index}"


@dataclass(slots=True)
class JobFigures:
    """What one finished job contributes; times are unix seconds (None when unknown)."""

    status: str  # succeeded | failed | cancelled
    num_prompt_tokens: int
    num_completion_tokens: int  # summed over samples
    num_samples: int
    created_at: float | None  # the API stored the job
    claimed_at: float | None  # a device group claimed it
    first_token_at: float | None
    finished_at: float


class WorkerMetrics:
    """A worker's buffer of increments, filled by the batcher, written by the heartbeat."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()  # HINCRBY fields
        self._sums: dict[str, float] = defaultdict(float)  # HINCRBYFLOAT fields (sums)
        self._last_engine: dict[str, int] = {}

    def observe_job(self, job: JobFigures) -> None:
        """Record a finished job (batcher thread; no I/O)."""
        with self._lock:
            self._counts[JOB_STATUS_FIELD + job.status] += 1
            self._counts["prompt_tokens"] += job.num_prompt_tokens
            self._counts["generation_tokens"] += job.num_completion_tokens
            start = job.created_at if job.created_at is not None else job.claimed_at
            if job.created_at is not None and job.claimed_at is not None:
                self._observe("queue_time", job.claimed_at - job.created_at)
            if start is not None:
                self._observe("e2e_request_latency", job.finished_at - start)
                if job.first_token_at is not None:
                    self._observe("time_to_first_token", job.first_token_at - start)
            # NOTE: one mean per job, counted once per token after each sample's first:
            # the sum and count are exact, the spread within a job is not kept.
            num_gaps = job.num_completion_tokens - job.num_samples
            if job.first_token_at is not None and num_gaps > 0:
                per_sample = job.num_completion_tokens / job.num_samples
                mean = (job.finished_at - job.first_token_at) / max(1.0, per_sample - 1.0)
                self._observe("inter_token_latency", mean, num_gaps)

    def observe_engine(self, figures: dict[str, Any]) -> None:
        """Record the growth of the engine's cumulative counters (heartbeat thread)."""
        with self._lock:
            for name in ENGINE_COUNTERS:
                value = int(figures.get(name) or 0)
                last = self._last_engine.get(name, 0)
                # a smaller value means a new engine: count from zero again
                self._counts[name] += value - last if value >= last else value
                self._last_engine[name] = value
            tiers = figures.get("kv_tiers") or {}
            for tier, values in tiers.items():
                for figure in KV_TIER_FIGURES:
                    field = kv_tier_field(figure, tier)
                    number = values.get(figure) or 0
                    last = self._last_engine.get(field, 0)
                    growth = number - last if number >= last else number
                    if figure.endswith("_seconds"):
                        self._sums[field] += float(growth)
                    else:
                        self._counts[field] += int(growth)
                    self._last_engine[field] = number

    def write(self, pipe: Any, settings: Settings,
              model: str) -> tuple[Counter[str], dict[str, float]]:
        """Queue the buffered increments on `pipe` and empty the buffer.

        Returns what was queued: give it to `restore` if the pipeline fails.
        """
        with self._lock:
            counts, sums = self._counts, self._sums
            self._counts, self._sums = Counter(), defaultdict(float)
        key = metrics_key(settings, model)
        for name, value in counts.items():
            if value:
                pipe.hincrby(key, name, value)
        for name, seconds in sums.items():
            if seconds:
                pipe.hincrbyfloat(key, name, seconds)
        return counts, sums

    def restore(self, written: tuple[Counter[str], dict[str, float]]) -> None:
        """Put back increments whose pipeline failed; the next beat writes them."""
        with self._lock:
            self._counts.update(written[0])
            for name, value in written[1].items():
                self._sums[name] += value

    def _observe(self, histogram: str, seconds: float, count: int = 1) -> None:
        seconds = max(0.0, seconds)
        bounds = HISTOGRAM_BUCKETS[histogram]
        self._counts[bucket_field(histogram, bisect.bisect_left(bounds, seconds))] += count
        self._counts[histogram + ":count"] += count
        self._sums[histogram + ":sum"] += seconds * count


def record_queued_cancel(redis: Any, settings: Settings, model: str) -> None:
    """Count a job the API cancelled before any worker claimed it (best effort)."""
    try:
        redis.hincrby(metrics_key(settings, model), JOB_STATUS_FIELD + "cancelled", 1)
    except Exception:  # noqa: BLE001 - a figure must never fail a cancel
        logger.warning("could not count a cancelled job of model %s", model)
