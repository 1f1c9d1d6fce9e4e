"""Web processes read the configured models before they serve: the first request to a
process does not wait for a tokenizer load (and the collection after it), nor does
anything queued behind it."""

from __future__ import annotations

import sys
import time

import pytest

from tasks.settings import Settings
from tests.fixtures_services import free_port
from tests.pipeline_helpers import serving_web, worker_env
from webapp.model_registry import ModelLoadError, ModelRegistry


def test_preload_loads_every_model_and_names_the_ones_that_fail(tiny_qwen3_dir, tmp_path):
    registry = ModelRegistry(Settings(models={"tiny": str(tiny_qwen3_dir),
                                              "broken": str(tmp_path)}))
    assert registry.preload() == ["broken"]
    loaded = registry.get("tiny")
    assert registry.get("tiny") is loaded and loaded.encode("hello")
    with pytest.raises(ModelLoadError):  # its requests get the error, as before
        registry.get("broken")


@pytest.mark.integration
def test_each_gunicorn_worker_process_loads_the_tokenizers_before_it_serves(
        service_settings, tmp_path):
    port = free_port()
    log_path = tmp_path / "web.log"
    command = [sys.executable, "-m", "gunicorn", "-w", "2", "--threads", "4",
               "-b", f"127.0.0.1:{port}", "webapp.wsgi:app"]
    with serving_web(command, worker_env(service_settings), log_path):
        # /health reads no model and nothing else is asked: a load logged is a preload
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lines = [line for line in log_path.read_text().splitlines()
                     if "loaded tokenizer of model tiny" in line]
            if len(lines) >= 2:
                break
            time.sleep(0.2)
        assert len(lines) == 2, log_path.read_text()[-2000:]
