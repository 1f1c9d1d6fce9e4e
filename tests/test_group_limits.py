"""The API refuses what no live group of the model can hold: a group serving a shorter
context than the checkpoint's (its --max-model-len, or a KV cache too small for the full
context) publishes it in its heartbeat, and a longer request is a 400, not a job that
fails in the worker."""

from __future__ import annotations

import uuid

import pytest
import requests

from tasks.models import JobStatus
from tests.pipeline_helpers import running_worker, wait_terminal

pytestmark = pytest.mark.integration


def test_requests_longer_than_every_live_group_serves_are_400s(
    service_settings, redis_client, session_factory, start_web, tmp_path
):
    settings = service_settings.with_overrides(
        redis_prefix=service_settings.redis_prefix + "g" + uuid.uuid4().hex[:6])
    base_url = start_web(settings)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    with running_worker(settings, redis_client, tmp_path, "short",
                        args=["--max-model-len", "64"]):
        too_long = requests.post(f"{base_url}/v1/jobs", timeout=30, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 100})
        assert too_long.status_code == 400, too_long.text
        error = too_long.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "fits 64" in error["message"]

        fits = requests.post(f"{base_url}/v1/jobs", timeout=30, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0.0})
        assert fits.status_code == 202, fits.text
        job = wait_terminal(session_factory, fits.json()["id"])
        assert job.status == JobStatus.SUCCEEDED.value, job.error

        # a chat request without a token limit gets the rest of what the group serves
        chat = requests.post(f"{base_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.0})
        assert chat.status_code == 200, chat.text
        usage = chat.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 64
