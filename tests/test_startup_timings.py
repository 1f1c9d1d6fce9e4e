"""Start-up timings kept on disk (workers/engine/startup_timings.py): a second start of
the same model on the same machine reads the first one's figures instead of timing, and
plans from them; another key, a damaged file or `off` times again."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kernels import linear as dense
from kernels import native
from workers.engine import model_runner as runner_module
from workers.engine.loader import load_checkpoint
from workers.engine.model_runner import ModelRunner
from workers.engine.startup_timings import TIMINGS_CACHE_ENV


@pytest.fixture
def timings_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(TIMINGS_CACHE_ENV, str(tmp_path / "timings"))
    monkeypatch.setenv("LLMQ_LINEAR_PATH", "auto")
    monkeypatch.setenv("LLMQ_CPU_KERNELS", "native")
    assert native.available(), "the native kernel did not build: see the log for the reason"
    return tmp_path / "timings"


def _runner(model_dir, dtype: str = "float32", **kwargs) -> ModelRunner:
    return ModelRunner(load_checkpoint(model_dir, dtype=dtype), kv_cache_bytes=1 << 20,
                       **kwargs)


def _no_timing(monkeypatch) -> None:
    """Every start-up timing fails the test if it runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("a start-up timing ran")
    monkeypatch.setattr(dense, "time_paths", refuse)
    monkeypatch.setattr(native, "time_row_prefetch", refuse)
    monkeypatch.setattr(native, "time_panel_row_prefetch", refuse)
    monkeypatch.setattr(native, "time_panel_row_streams", refuse)
    monkeypatch.setattr(native, "time_row_streams", refuse)
    monkeypatch.setattr(runner_module, "alternated_medians", refuse)


def _logits(runner: ModelRunner) -> torch.Tensor:
    from tasks.params import SamplingParams
    from workers.engine.step_io import ScheduledSequence, SchedulerOutput

    prompt = [3, 14, 15, 92, 65]
    step = SchedulerOutput([ScheduledSequence(
        seq_id=0, token_ids=prompt, start_pos=0, block_table=[0], sample=True,
        params=SamplingParams(temperature=0.0, max_tokens=1), prompt_token_ids=prompt,
        output_token_ids=[])], len(prompt))
    return runner.forward_logits(step)


def _plan(runner: ModelRunner) -> tuple:
    return (runner.linear_path, runner.plain_rows, runner.skinny_rows, runner.decoder_rows,
            runner.row_prefetch, runner.panel_row_prefetch, runner.panel_row_streams,
            runner.row_streams)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_second_start_reads_the_first_ones_timings_and_plans_the_same(
        tiny_qwen3_tied_dir, timings_dir, monkeypatch, caplog, dtype):
    first = _runner(tiny_qwen3_tied_dir, dtype)
    assert first.linear_probe, "the first start timed nothing"
    files = list(timings_dir.glob("*.json"))
    assert files == [first.timings_cache.path]
    stored = json.loads(files[0].read_text())
    assert stored["key"]["cpu"] and stored["key"]["code"]
    expected_logits = _logits(first)

    _no_timing(monkeypatch)
    with caplog.at_level(logging.INFO, logger="workers.engine.model_runner"):
        second = _runner(tiny_qwen3_tied_dir, dtype)
    assert "start-up timings read from" in caplog.text
    assert second.linear_probe == first.linear_probe
    assert second.decoder_probe == first.decoder_probe
    assert second.row_prefetch_probe == first.row_prefetch_probe
    assert second.panel_prefetch_probe == first.panel_prefetch_probe
    assert second.panel_streams_probe == first.panel_streams_probe
    assert second.row_streams_probe == first.row_streams_probe
    assert _plan(second) == _plan(first)
    assert torch.equal(_logits(second), expected_logits)


def test_the_stored_figures_decide_the_plan(tiny_qwen3_tied_dir, timings_dir, monkeypatch):
    """Figures in which torch's linear wins every row count plan torch's linear, with no
    native kernel and no decoder: the plan follows the file, not a timing of its own."""
    first = _runner(tiny_qwen3_tied_dir)
    assert first.skinny_rows > 0, "timed, the tiny model's plan gives the native kernel rows"
    path = first.timings_cache.path
    record = json.loads(path.read_text())
    record["linear_probe"] = {m: {name: (0.001 if name == "reference" else 0.5)
                                  for name in paths}
                              for m, paths in record["linear_probe"].items()}
    record["decoder_probe"] = {}
    path.write_text(json.dumps(record))

    _no_timing(monkeypatch)
    second = _runner(tiny_qwen3_tied_dir)
    assert second.linear_path == "reference"
    assert second.skinny_rows == 0 and second.decoder_rows == 0
    assert second.model.model.native_decoder is None


def test_another_key_a_damaged_file_or_off_times_again(tiny_qwen3_tied_dir, timings_dir,
                                                       monkeypatch, caplog):
    first = _runner(tiny_qwen3_tied_dir)
    calls = []
    time_paths = dense.time_paths

    def counted(*args, **kwargs):
        calls.append(1)
        return time_paths(*args, **kwargs)
    monkeypatch.setattr(dense, "time_paths", counted)

    # another key: decode steps stop at 2 rows here (max_num_seqs), so the figures differ
    other = _runner(tiny_qwen3_tied_dir, max_num_seqs=2)
    assert calls == [1] and other.timings_cache.path != first.timings_cache.path
    assert len(list(timings_dir.glob("*.json"))) == 2

    # a damaged file: timed again (logged), and replaced by a whole one
    first.timings_cache.path.write_text('{"key": {"cpu": ')
    with caplog.at_level(logging.WARNING, logger="workers.engine.startup_timings"):
        again = _runner(tiny_qwen3_tied_dir)
    assert calls == [1, 1] and "unreadable" in caplog.text
    assert json.loads(again.timings_cache.path.read_text())["linear_probe"]

    # a file of another key under this name (say, copied from another machine): timed again
    record = json.loads(first.timings_cache.path.read_text())
    record["key"]["cpu"] = "another CPU"
    first.timings_cache.path.write_text(json.dumps(record))
    _runner(tiny_qwen3_tied_dir)
    assert calls == [1, 1, 1]

    # figures of this key that no start could have written (a hand edit): timed again
    for damage in ({"linear_probe": {"1": {"native": 0.001}}},
                   {"linear_probe": {"1": {"reference": 0.1, "prepacked": 0.1},
                                     "2": {"reference": 0.1}}},
                   {"decoder_probe": {"32": {"plan": 0.001}}},
                   {"row_prefetch_probe": {"0": -1.0}},
                   {"panel_prefetch_probe": {"0": "fast"}}):
        json_record = json.loads(first.timings_cache.path.read_text())
        json_record["key"] = first.timings_cache.key
        first.timings_cache.path.write_text(json.dumps(json_record | damage))
        _runner(tiny_qwen3_tied_dir)
    assert calls == [1] * 8

    # off: timed, nothing kept
    monkeypatch.setenv(TIMINGS_CACHE_ENV, "off")
    for path in timings_dir.glob("*.json"):
        path.unlink()
    off = _runner(tiny_qwen3_tied_dir)
    assert calls == [1] * 9 and off.timings_cache is None
    assert not list(timings_dir.glob("*.json"))


def test_a_fixed_linear_path_neither_reads_nor_keeps_timings(tiny_qwen3_tied_dir, timings_dir,
                                                             monkeypatch):
    monkeypatch.setenv("LLMQ_LINEAR_PATH", "prepacked")
    runner = _runner(tiny_qwen3_tied_dir)
    assert runner.timings_cache is None and runner.linear_probe == {}
    assert not timings_dir.exists() or not list(timings_dir.glob("*.json"))


def test_alternated_medians_stops_timing_a_run_that_cannot_win(monkeypatch):
    """A run 1.5x slower than the fastest after the settling rounds is timed no more and
    keeps its median; the runs within reach are timed every round; `warmed` keys skip the
    warm-up round."""
    import types

    from kernels import timing

    clock = [0.0]
    calls: dict[str, int] = {"fast": 0, "close": 0, "slow": 0}
    cost = {"fast": 1.0, "close": 1.3, "slow": 2.0}

    def run(name: str) -> None:
        calls[name] += 1
        clock[0] += cost[name]

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    runs = {name: (lambda name=name: run(name)) for name in cost}
    medians = timing.alternated_medians(runs, 7, drop_slower=1.5, settle_rounds=3)
    assert medians == pytest.approx(cost)
    assert calls == {"fast": 8, "close": 8, "slow": 4}  # warm-up + 7, warm-up + 3

    calls.update(dict.fromkeys(calls, 0))
    assert timing.alternated_medians(runs, 7, warmed=("fast",)) == pytest.approx(cost)
    assert calls == {"fast": 7, "close": 8, "slow": 8}


def test_without_a_home_directory_nothing_is_kept(monkeypatch, caplog):
    from pathlib import Path

    from workers.engine import startup_timings

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv(TIMINGS_CACHE_ENV, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with caplog.at_level(logging.WARNING, logger="workers.engine.startup_timings"):
        assert startup_timings.cache_dir() is None
        assert startup_timings.TimingsCache.configured(config="x") is None
    assert TIMINGS_CACHE_ENV in caplog.text
