"""Session-scoped random checkpoints, built once per test run (fp32, `tiny` preset).

`tiny_qwen3_dir`, `tiny_qwen2_dir`, `tiny_llama_dir` (with `llama3` rope scaling) are used
across the suite; `tiny_qwen3_tied_dir` ties the embedding and output projection.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def _build(factory: pytest.TempPathFactory, name: str, **kwargs) -> Path:
    from workers.engine.make_model import make_model

    return make_model(factory.mktemp(name), preset="tiny", seed=0, dtype="float32", **kwargs)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "tiny_qwen3", arch="qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "tiny_qwen2", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "tiny_llama", arch="llama", rope_scaling=True)


@pytest.fixture(scope="session")
def tiny_qwen3_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "tiny_qwen3_tied", arch="qwen3", tie_word_embeddings=True)
