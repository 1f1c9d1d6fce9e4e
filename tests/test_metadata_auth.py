"""With auth on, /v1/models and /metrics (checkpoint paths, hosts, pids) need a key unless
the deployment opens them; /health and /ready stay open for probes."""

from __future__ import annotations

import uuid

import requests

from tasks.auth import create_api_key


def test_models_and_metrics_need_a_key_when_auth_is_on(service_settings, session_factory,
                                                       start_web):
    settings = service_settings.with_overrides(
        auth_enabled=True, redis_prefix=service_settings.redis_prefix + uuid.uuid4().hex[:6])
    base_url = start_web(settings)
    _, key = create_api_key(session_factory, "metadata-reader")
    for path in ("/v1/models", "/metrics"):
        anonymous = requests.get(base_url + path, timeout=30)
        assert anonymous.status_code == 401, (path, anonymous.text)
        assert anonymous.json()["error"]["code"] == "missing_api_key"
        with_key = requests.get(base_url + path, timeout=30,
                                headers={"Authorization": f"Bearer {key}"})
        assert with_key.status_code == 200, (path, with_key.text)
    assert requests.get(base_url + "/health", timeout=30).status_code == 200

    opened = start_web(settings.with_overrides(metadata_requires_key=False))
    for path in ("/v1/models", "/metrics"):
        assert requests.get(opened + path, timeout=30).status_code == 200, path
