"""The `llmq` command as a newcomer meets it: version, help with defaults, safe defaults,
messages that say what to do, and `make-model` that never leaves half a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmq.cli import build_parser
from tests.fixtures_services import free_port

REPO = Path(__file__).resolve().parent.parent


def _llmq(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "llmq.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_version_and_help_show_defaults(tmp_path):
    version = _llmq("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("llmq ")
    web_help = _llmq("web", "--help", cwd=tmp_path).stdout
    assert "(default: 127.0.0.1)" in web_help and "(default: 8000)" in web_help
    assert "--state-dir" in web_help and "--database-url" in web_help


def test_web_listens_on_loopback_unless_told():
    assert build_parser().parse_args(["web"]).host == "127.0.0.1"
    assert build_parser().parse_args(["web", "--host", "0.0.0.0"]).host == "0.0.0.0"


def test_settings_default_database_is_the_state_dirs():
    from tasks.settings import Settings

    assert Settings().database_url == "sqlite:///.llmq/llmq.db"
    assert Settings.from_env({}).database_url == "sqlite:///.llmq/llmq.db"
    assert Settings.from_env({"LLMQ_STATE_DIR": "/s"}).database_url == "sqlite:////s/llmq.db"
    given = {"LLMQ_STATE_DIR": "/s", "LLMQ_DATABASE_URL": "postgresql://h/db"}
    assert Settings.from_env(given).database_url == "postgresql://h/db"


def test_up_with_a_hub_id_says_to_download_it(tmp_path):
    result = _llmq("up", "--model", "Qwen/Qwen3-0.6B", "--port", str(free_port()),
                   cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "huggingface-cli download Qwen/Qwen3-0.6B --local-dir" in result.stderr
    assert "Traceback" not in result.stderr


def test_submit_without_a_server_points_at_llmq_up(tmp_path):
    result = _llmq("submit", "hi", "--url", f"http://127.0.0.1:{free_port()}", cwd=tmp_path)
    assert result.returncode == 1
    assert "llmq up" in result.stderr and "--url" in result.stderr


def test_make_model_rejects_a_bad_arch_before_loading_anything(tmp_path):
    result = _llmq("make-model", "m", "--arch", "gpt9", cwd=tmp_path)
    assert result.returncode == 2 and "invalid choice: 'gpt9'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_make_model_leaves_nothing_on_failure_and_never_overwrites(tmp_path):
    from workers.engine.make_model import make_model

    with pytest.raises(ValueError, match="unknown arch"):
        make_model(tmp_path / "bad", arch="gpt9")
    with pytest.raises(ValueError):  # fails while saving, after the tokenizer was written
        make_model(tmp_path / "half", max_shard_size="lots")
    assert list(tmp_path.iterdir()) == []  # no out dir, no temporary dir beside it

    out = make_model(tmp_path / "m", seed=1)
    weights = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        make_model(out, seed=2)
    assert (out / "model.safetensors").read_bytes() == weights
    make_model(out, seed=2, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    refused = _llmq("make-model", str(out), cwd=tmp_path)
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("preset", ["tiny", "small", "100m"])
def test_every_token_id_of_a_preset_decodes_to_text(tmp_path, preset):
    """A random model samples every id of its vocabulary: each must be some text."""
    from transformers import AutoTokenizer

    from workers.engine.make_model import PRESETS, _train_tokenizer

    vocab_size = PRESETS[preset].vocab_size
    _ids, num_tokens = _train_tokenizer(tmp_path, vocab_size)
    assert num_tokens == vocab_size
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == vocab_size
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)])
    assert [i for i, text in enumerate(texts) if not text] == []
    # filler entries never come out of encoding: ordinary text encodes as before
    assert max(tokenizer("The river runs past the old mill")["input_ids"]) < 780
