"""`GET /metrics`: Prometheus text rendered from what the workers record in Redis.

Every web process renders the same numbers: counters and histograms come from the
per-model hashes `tasks.metrics` maintains, gauges from the live group heartbeats. A
fresh `CollectorRegistry` per scrape, so nothing is kept in (or differs between) processes,
except `llmq:sse_open_streams`: the event streams this process itself holds open.
Names follow vLLM's under an `llmq:` prefix, labelled by `model_name`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from tasks.metrics import (
    ENGINE_COUNTERS,
    HISTOGRAM_BUCKETS,
    JOB_STATUS_FIELD,
    KV_TIER_FIELD,
    KV_TIER_FIGURES,
    bucket_field,
    metrics_key,
)
from tasks.models import JobStatus
from tasks.protocol import group_alive_key, groups_key
from webapp.auth import require_key_for_metadata
from webapp.services import Services, services

logger = logging.getLogger(__name__)

bp = Blueprint("metrics", __name__)

HISTOGRAMS = {  # our field prefix -> (metric name, help)
    "queue_time": ("llmq:request_queue_time_seconds",
                   "Seconds from job submission until a device group claimed it."),
    "time_to_first_token": ("llmq:time_to_first_token_seconds",
                            "Seconds from job submission to its first token."),
    "inter_token_latency": ("llmq:inter_token_latency_seconds",
                            "Seconds between consecutive tokens of a job (per-job mean)."),
    "e2e_request_latency": ("llmq:e2e_request_latency_seconds",
                            "Seconds from job submission to its end."),
}
COUNTERS = {  # field -> (metric name without _total, help)
    "prompt_tokens": ("llmq:prompt_tokens", "Prompt tokens of finished jobs."),
    "generation_tokens": ("llmq:generation_tokens", "Generated tokens of finished jobs."),
    "prefix_cache_queries": ("llmq:prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("llmq:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("llmq:num_preemptions", "Sequences preempted (KV cache full)."),
    "num_interrupted_steps": ("llmq:interrupted_steps",
                              "Batch-only steps stopped between layers to start an "
                              "interactive job."),
}
assert set(ENGINE_COUNTERS) <= set(COUNTERS)


@bp.get("/metrics")
def metrics() -> Response:
    """Prometheus text exposition of every served model's figures."""
    require_key_for_metadata()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(services()))
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST.split(";")[0],
                    headers={"Content-Type": CONTENT_TYPE_LATEST})


class RedisCollector:
    """A prometheus_client collector reading one snapshot of Redis per scrape."""

    def __init__(self, svc: Services) -> None:
        self.svc = svc

    def collect(self) -> Iterator[Metric]:
        models = self.svc.models.names()
        hashes, groups = self._read(models)
        running = GaugeMetricFamily("llmq:num_requests_running",
                                    "Sequences in the engines' running batches.",
                                    labels=["model_name"])
        waiting = GaugeMetricFamily("llmq:num_requests_waiting",
                                    "Sequences admitted and waiting for room in the engines.",
                                    labels=["model_name"])
        live_groups = GaugeMetricFamily("llmq:num_device_groups",
                                        "Live device groups serving the model.",
                                        labels=["model_name"])
        kv_usage = GaugeMetricFamily("llmq:kv_cache_usage_perc",
                                     "Fraction of KV cache blocks in use (1 = full).",
                                     labels=["model_name", "group"])
        for model in models:
            model_groups = groups[model]
            running.add_metric([model], sum(float(g.get("num_running", 0))
                                            for g in model_groups.values()))
            waiting.add_metric([model], sum(float(g.get("num_waiting", 0))
                                            for g in model_groups.values()))
            live_groups.add_metric([model], len(model_groups))
            for group_id, figures in sorted(model_groups.items()):
                kv_usage.add_metric([model, group_id], float(figures.get("kv_cache_usage", 0.0)))
        yield from (running, waiting, live_groups, kv_usage)
        # NOTE: of this web process only (not read from Redis): each process holds its own
        yield GaugeMetricFamily("llmq:sse_open_streams",
                                "Readers of live job events in this web process: open "
                                "event streams and OpenAI requests waiting for their job.",
                                value=float(self.svc.subscriber.num_listening()))

        for field, (name, help_text) in COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["model_name"])
            for model in models:
                family.add_metric([model], float(hashes[model].get(field, 0)))
            yield family
        finished = CounterMetricFamily("llmq:request_finished", "Jobs by terminal status.",
                                       labels=["model_name", "status"])
        for model in models:
            for status in JobStatus:
                if status.is_terminal:
                    finished.add_metric([model, status.value], float(
                        hashes[model].get(JOB_STATUS_FIELD + status.value, 0)))
        yield finished
        yield from _kv_tier_families(models, hashes)

        for prefix, (name, help_text) in HISTOGRAMS.items():
            histogram = HistogramMetricFamily(name, help_text, labels=["model_name"])
            bounds = HISTOGRAM_BUCKETS[prefix]
            for model in models:
                values = hashes[model]
                cumulative, buckets = 0.0, []
                for index, bound in enumerate((*bounds, float("inf"))):
                    cumulative += float(values.get(bucket_field(prefix, index), 0))
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound),
                                    cumulative))
                histogram.add_metric([model], buckets,
                                     float(values.get(prefix + ":sum", 0.0)))
            yield histogram

    def _read(self, models: list[str]) -> tuple[dict[str, dict[str, str]],
                                                 dict[str, dict[str, dict[str, Any]]]]:
        svc = self.svc
        pipe = svc.redis.pipeline(transaction=False)
        for model in models:
            pipe.hgetall(metrics_key(svc.settings, model))
            pipe.hgetall(groups_key(svc.settings, model))
        replies = pipe.execute()
        hashes = {m: _decode(replies[2 * i]) for i, m in enumerate(models)}
        beats = {m: _decode(replies[2 * i + 1]) for i, m in enumerate(models)}
        pipe = svc.redis.pipeline(transaction=False)
        candidates = [(m, g) for m in models for g in beats[m]]
        for model, group_id in candidates:
            pipe.exists(group_alive_key(svc.settings, model, group_id))
        alive = {c for c, exists in zip(candidates, pipe.execute()) if exists}
        groups: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in models}
        for model, group_id in alive:
            try:
                figures = json.loads(beats[model][group_id])
            except ValueError:
                continue
            if isinstance(figures, dict):
                groups[model][group_id] = figures
        return hashes, groups


def _kv_tier_families(models: list[str], hashes: dict[str, dict[str, str]]) -> Iterator[Metric]:
    """`llmq:kv_tier_<figure>_total{model_name, tier}` from `kv_tier:<figure>:<tier>`."""
    families = {figure: CounterMetricFamily(f"llmq:kv_tier_{figure}", help_text,
                                            labels=["model_name", "tier"])
                for figure, help_text in KV_TIER_FIGURES.items()}
    for model in models:
        for field, value in sorted(hashes[model].items()):
            if not field.startswith(KV_TIER_FIELD):
                continue
            figure, _, tier = field[len(KV_TIER_FIELD):].partition(":")
            if figure in families:
                families[figure].add_metric([model, tier], float(value))
    yield from families.values()


def _decode(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}
