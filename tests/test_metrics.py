"""`/metrics`: figures the worker records in Redis, rendered alike by every web process."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tasks.models import JobStatus
from tests.pipeline_helpers import running_worker, submit, wait_for, wait_terminal

pytestmark = pytest.mark.integration


# a model name of our own: the worker claims queued jobs of its model from the table (the
# session's other tests may leave some of "tiny" queued), and only ours must count
MODEL = "tiny-metrics"


@pytest.fixture(scope="module")
def settings(service_settings):
    # NOTE: a prefix of our own (under the session's, which cleans it up), so the figures
    # start from zero whatever ran before in this session
    return service_settings.with_overrides(
        redis_prefix=service_settings.redis_prefix + "m",
        models={**service_settings.models, MODEL: service_settings.models["tiny"]})


@pytest.fixture(scope="module")
def worker(settings, redis_client, tmp_path_factory):
    with running_worker(settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "metrics", model=MODEL) as process:
        yield process


def _scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = requests.get(f"{base_url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def test_metrics_count_finished_jobs_alike_in_every_web_process(start_web, settings, worker,
                                                                session_factory):
    web_a, web_b = start_web(settings), start_web(settings)
    jobs = [submit(web_a, model=MODEL, prompt=f"metrics prompt {i}", max_tokens=4 + i,
                   temperature=0.0, ignore_eos=True) for i in range(3)]
    rows = [wait_terminal(session_factory, job["id"]) for job in jobs]
    assert all(row.status == JobStatus.SUCCEEDED.value for row in rows)
    num_prompt = sum(row.prompt_tokens for row in rows)
    num_generated = sum(row.completion_tokens for row in rows)
    assert num_generated == 4 + 5 + 6

    # the heartbeat carries the figures to Redis within a beat
    # (the engine's figures, e.g. the running count, within the next one)
    samples = wait_for(lambda: (lambda s: s if _value(
        s, "llmq:time_to_first_token_seconds_count") == 3 and _value(
        s, "llmq:num_requests_running") == 0 else None)(_scrape(web_a)),
        15, "the TTFT histogram to count 3 jobs, none running")
    assert _value(samples, "llmq:prompt_tokens_total") == num_prompt
    assert _value(samples, "llmq:generation_tokens_total") == num_generated
    assert _value(samples, "llmq:request_finished_total", status="succeeded") == 3
    assert _value(samples, "llmq:request_finished_total", status="failed") == 0
    for name in ("llmq:e2e_request_latency_seconds", "llmq:request_queue_time_seconds"):
        assert _value(samples, name + "_count") == 3
        assert _value(samples, name + "_bucket", le="+Inf") == 3
        assert _value(samples, name + "_sum") > 0
    # one gap between consecutive tokens per token after the first
    assert _value(samples, "llmq:inter_token_latency_seconds_count") == num_generated - 3
    ttft_sum = _value(samples, "llmq:time_to_first_token_seconds_sum")
    e2e_sum = _value(samples, "llmq:e2e_request_latency_seconds_sum")
    assert 0 < ttft_sum <= e2e_sum
    assert _value(samples, "llmq:num_device_groups") == 1
    assert _value(samples, "llmq:num_requests_running") == 0
    assert ("llmq:kv_cache_usage_perc", (("group", worker.group_id),
                                         ("model_name", MODEL))) in samples
    assert _value(samples, "llmq:prefix_cache_queries_total") >= 0

    # a second web app (another process in production) renders the same numbers
    other = _scrape(web_b)
    for name in ("llmq:prompt_tokens_total", "llmq:generation_tokens_total",
                 "llmq:time_to_first_token_seconds_count",
                 "llmq:time_to_first_token_seconds_sum"):
        assert _value(other, name) == _value(samples, name)
