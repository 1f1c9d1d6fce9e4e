"""A prefix computed on one device group is a KV tier hit on another.

Real HTTP, Postgres, Redis and worker processes: group 1 runs job A with a long prompt
and stores its blocks to a shared Redis tier; group 1 stops; group 2 (a fresh process, an
empty device cache) runs job B with the same long prefix, loads the prefix from the tier
(`cached_tokens` > 0) and outputs what the offline engine outputs. The tier figures reach
`/metrics`.
"""

from __future__ import annotations

import uuid

import pytest
import redis
import requests

from tasks.models import JobStatus
from tests.pipeline_helpers import WorkerProcess, get_job, submit, wait_for, wait_terminal

pytestmark = pytest.mark.integration

PREFIX = " ".join(f"word{i} river stone" for i in range(60))  # a few hundred tokens
BODY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
WORKER_ARGS = ["--max-num-seqs", "4", "--kv-cache-bytes", str(4 * 1024 * 1024),
               "--concurrency", "1"]


@pytest.fixture
def kv_tier_url(redis_url: str, service_settings):
    """Database 3 of the test Redis; our keys (under the session's prefix) removed after."""
    url = redis_url.rsplit("/", 1)[0] + "/3"
    yield f"{url}?ttl_seconds=600"
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=service_settings.redis_prefix + ":kv:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def test_a_prefix_computed_on_one_group_is_a_tier_hit_on_another(
        start_web, service_settings, redis_client, session_factory, kv_tier_url,
        tmp_path) -> None:
    from tasks.params import SamplingParams
    from workers.engine.llm import LLM

    base_url = start_web(service_settings)
    args = [*WORKER_ARGS, "--kv-tier", kv_tier_url]
    first = WorkerProcess(service_settings, f"tier-1-{uuid.uuid4().hex[:4]}", tmp_path,
                          args=args)
    try:
        first.wait_ready(redis_client)
        job_a = submit(base_url, prompt=PREFIX + " first question", **BODY)
        row_a = wait_terminal(session_factory, job_a["id"])
        assert row_a.status == JobStatus.SUCCEEDED.value and row_a.worker == first.group_id
    finally:
        assert first.terminate() == 0, first.log_tail()  # drain writes queued KV blocks
    client = redis.Redis.from_url(kv_tier_url.split("?")[0])
    num_keys = len(list(client.scan_iter(match=service_settings.redis_prefix + ":kv:*")))
    client.close()
    assert num_keys > 0, "group 1 stored no KV block to the tier"

    second = WorkerProcess(service_settings, f"tier-2-{uuid.uuid4().hex[:4]}", tmp_path,
                           args=args)
    try:
        second.wait_ready(redis_client)
        prompt_b = PREFIX + " second question"
        job_b = submit(base_url, prompt=prompt_b, **BODY)
        row_b = wait_terminal(session_factory, job_b["id"])
        assert row_b.status == JobStatus.SUCCEEDED.value and row_b.worker == second.group_id
        offline = LLM(service_settings.models["tiny"], max_num_seqs=4,
                      kv_cache_bytes=4 * 1024 * 1024)
        tokens_a = offline.engine.tokenize(PREFIX + " first question")
        tokens_b = offline.engine.tokenize(prompt_b)
        common = next(i for i, (a, b) in enumerate(zip(tokens_a, tokens_b)) if a != b)
        usage = get_job(base_url, job_b["id"])["usage"]
        # every full block of the shared prefix came from the tier (group 2's device
        # cache was empty)
        assert common >= 64 and usage["cached_tokens"] == common // 16 * 16, (common, usage)
        expected = offline.generate([prompt_b], SamplingParams(**BODY))[0]
        assert row_b.output[0]["token_ids"] == expected.token_ids
        assert row_b.output_text == expected.text.replace("\x00", "\ufffd")

        def tier_hits() -> float:
            text = requests.get(f"{base_url}/metrics", timeout=10).text
            for line in text.splitlines():
                if line.startswith("llmq:kv_tier_hit_blocks_total{") and 'model_name="tiny"' \
                        in line:
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        assert wait_for(tier_hits, 20, "kv tier hits in /metrics") >= 1
    finally:
        second.terminate()
