"""A worker that cannot load its model says why in one line and exits non-zero, so a
supervisor (compose, llmq up) sees a failure, not a clean stop."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.pipeline_helpers import REPO, worker_env

pytestmark = pytest.mark.integration


def test_a_bad_checkpoint_exits_non_zero_naming_the_problem(service_settings, tiny_qwen3_dir,
                                                            tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    result = subprocess.run(
        [sys.executable, "-m", "workers.main", "--model-name", "tiny", "--model-dir",
         str(broken), "--group-id", "broken"],
        cwd=REPO, env=worker_env(service_settings), capture_output=True, text=True,
        timeout=120, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "exits after a failure: could not load model 'tiny'" in last, last
    assert str(broken) in last
