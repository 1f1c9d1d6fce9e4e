"""The native CPU kernel for projections of few rows (kernels/native.py): its results
against torch's `linear`, how the start-up timing turns into a plan, the engine's tokens on
it, and the fallback where it cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from kernels import linear as dense
from kernels import native


@pytest.fixture(autouse=True)
def _built():
    # NOTE: no skip: a machine that runs the suite has a C compiler, as a worker host needs
    assert native.available(), "the native kernel did not build: see the log for the reason"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, out_features, in_features", [
    (1, 7, 5), (2, 33, 31), (3, 64, 64), (4, 130, 96), (5, 100, 768), (9, 256, 200),
    (1, 768, 2048), (18, 70, 64), (1, 9, 59), (7, 65, 40), (13, 97, 48), (64, 40, 32)])
def test_the_kernel_equals_torch_linear_within_the_summation_order(dtype, rows, out_features,
                                                                   in_features):
    """Every row count (4 x-rows a pass, 6 in the AVX2 tiles, split evenly; on AMX,
    blocks of 16 and the rest), feature counts that are and are not multiples of the
    vector width, of the tiles' rows and of the AVX2 blocks of 32 weight rows, with and
    without bias, and x rows with a stride wider than their length."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    wide = torch.randn(rows, in_features + 3, generator=gen).to(dtype)
    x = wide[:, :in_features]  # rows strided by in_features + 3
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    assert native.supports(weight)
    for b in (None, bias):
        got = native.skinny_linear(x, weight, b)
        want = F.linear(x, weight, b)
        assert got.shape == want.shape and got.dtype == dtype
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        if dtype == torch.float32:
            assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4)
        else:
            # fp32 sums rounded once to bf16, as torch's: at most one bf16 step apart
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
            assert (got != want).float().mean() <= 0.02


@pytest.mark.parametrize("rows, out_features, in_features", [
    (1, 7, 5), (2, 33, 31), (1, 768, 2048), (5, 100, 768), (11, 64, 64), (12, 32, 16),
    (13, 97, 48), (25, 130, 96), (64, 40, 32), (70, 65, 40)])
def test_panels_equal_the_exact_product(rows, out_features, in_features):
    """fp32 weights packed in panels: every row count (groups of up to 12 x rows on
    AVX-512, 6 on AVX2, split evenly), feature counts that do and do not fill the last
    panel, with and without bias, x rows strided wider than their length; a plain weight
    from the panels' zeros past the last row never shows."""
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features + 5, generator=gen)[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    panels = native.pack_panels(weight)
    width = panels.shape[2]
    assert panels.shape == (-(-out_features // width), in_features, width)
    assert torch.equal(panels.permute(0, 2, 1).reshape(-1, in_features)[:out_features], weight)
    assert not panels.permute(0, 2, 1).reshape(-1, in_features)[out_features:].any()
    for b in (None, bias):
        got = native.panel_linear(x, panels, out_features, b)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4)


def test_panels_refuse_what_they_cannot_compute():
    weight = torch.randn(8, 16)
    panels = native.pack_panels(weight)
    with pytest.raises(TypeError, match="fp32"):
        native.panel_linear(torch.randn(2, 16, dtype=torch.bfloat16), panels, 8)
    with pytest.raises(ValueError, match="16"):
        native.panel_linear(torch.randn(2, 15), panels, 8)
    with pytest.raises(ValueError, match="give"):
        native.panel_linear(torch.randn(2, 16), panels, panels.shape[0] * panels.shape[2] + 1)
    assert not native.panels_supported(weight.to(torch.bfloat16))
    assert not native.panels_supported(weight.t())  # not contiguous
    assert not native.panels_supported(dense.prepack(weight))


def test_the_kernel_refuses_what_it_cannot_compute():
    weight = torch.randn(8, 16)
    with pytest.raises(TypeError, match="share a dtype"):
        native.skinny_linear(torch.randn(2, 16).bfloat16(), weight)
    with pytest.raises(ValueError, match="16"):
        native.skinny_linear(torch.randn(2, 15), weight)
    assert not native.supports(weight.half())
    assert not native.supports(weight.t())  # not contiguous
    assert not native.supports(dense.prepack(weight))


def _times(**by_size: dict[str, float]) -> dict[int, dict[str, float]]:
    return {int(m[1:]): paths for m, paths in by_size.items()}


@pytest.mark.parametrize("times, plan", [
    # native fastest at 1 and 2 rows, prepacked above: both copies, the split at 2
    (_times(m1={"reference": 3, "prepacked": 2, "native": 1},
            m2={"reference": 3, "prepacked": 2, "native": 1},
            m4={"reference": 3, "prepacked": 1, "native": 2}),
     dense.LinearPlan("native", prepack=True, plain_rows=2, skinny_rows=2)),
    # native at 1, torch's linear at 2, prepacked at 4: the plain weight serves up to 2
    (_times(m1={"reference": 3, "prepacked": 2, "native": 1},
            m2={"reference": 1, "prepacked": 2, "native": 3},
            m4={"reference": 3, "prepacked": 1, "native": 2}),
     dense.LinearPlan("native", prepack=True, plain_rows=2, skinny_rows=1)),
    # native everywhere probed: torch's linear above, when it beats prepacking at the top
    (_times(m1={"reference": 3, "prepacked": 4, "native": 1},
            m4={"reference": 3, "prepacked": 4, "native": 1}),
     dense.LinearPlan("native", skinny_rows=4)),
    # native wins only past one row: no native (a gap at one row)
    (_times(m1={"reference": 1, "prepacked": 2, "native": 3},
            m4={"reference": 3, "prepacked": 2, "native": 1}),
     dense.LinearPlan("split", prepack=True, plain_rows=1)),
    (_times(m1={"reference": 3, "prepacked": 1, "native": 2},
            m4={"reference": 3, "prepacked": 1, "native": 2}),
     dense.LinearPlan("prepacked", prepack=True)),
    (_times(m1={"reference": 1, "prepacked": 3}, m4={"reference": 1, "prepacked": 3}),
     dense.LinearPlan("reference")),
    (_times(m1={"reference": 2, "native": 1}, m4={"reference": 1, "native": 2}),
     dense.LinearPlan("native", skinny_rows=1)),
    # a few percent behind at one row, far ahead from 8 rows on: native takes the range
    # (fp32 panels on a Xeon with AVX-512: the sum over the probed rows decides)
    (_times(m1={"reference": 1.00, "prepacked": 1.2, "native": 1.04},
            m8={"reference": 2.9, "prepacked": 1.5, "native": 1.2},
            m16={"reference": 2.5, "prepacked": 1.7, "native": 1.3}),
     dense.LinearPlan("native", prepack=True, plain_rows=16, skinny_rows=16)),
])
def test_the_plan_follows_the_timing(times, plan):
    assert dense.choose_plan(times) == plan


def _greedy_tokens(model_dir: str, dtype: str, monkeypatch, path: str,
                   step_kernels: str) -> list[list[int]]:
    from kernels import dispatch
    from tasks.params import SamplingParams
    from workers.engine.llm import LLM

    monkeypatch.setenv("LLMQ_LINEAR_PATH", path)
    monkeypatch.setenv("LLMQ_CPU_KERNELS", step_kernels)
    prompts = [[5, 9, 13, 2 + i, 7] * (1 + i) for i in range(6)]  # decode batches of 1-6
    with LLM(model_dir, dtype=dtype, kv_cache_bytes=4 << 20) as llm:
        runner = llm.engine.runner
        assert runner.linear_path == path and runner.step_kernels == step_kernels
        native_ops = dispatch.get("rms_norm", "cpu") is native.rms_norm
        assert native_ops == (step_kernels == "native")
        outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i,
                                                        ignore_eos=True)
                                         for i in range(len(prompts))])
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_on_the_native_kernels_gives_the_reference_tokens(
        tiny_qwen3_tied_dir, dtype, monkeypatch):
    """Greedy tokens of a batch whose decodes shrink from 6 rows to 1 (native projections
    up to 4, prepacked above; native norms, rotary, activation, KV store and decode
    attention) equal the pure-torch reference throughout, in fp32 and in bf16."""
    native_tokens = _greedy_tokens(tiny_qwen3_tied_dir, dtype, monkeypatch, "native",
                                   "native")
    assert native_tokens == _greedy_tokens(tiny_qwen3_tied_dir, dtype, monkeypatch,
                                           "reference", "reference")


def test_the_runner_times_three_paths_and_applies_the_plan(tiny_qwen3_tied_dir, monkeypatch):
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner
    from workers.engine.models.layers import LinearBase, ParallelLMHead

    monkeypatch.setenv("LLMQ_LINEAR_PATH", "auto")
    loaded = load_checkpoint(tiny_qwen3_tied_dir, dtype="bfloat16")
    runner = ModelRunner(loaded, kv_cache_bytes=1 << 20)
    times = runner.linear_probe
    bf16 = torch.empty(2, 2, dtype=torch.bfloat16)
    # (and 32, 64 rows where the CPU has no bf16 dot product)
    assert set(times) == set(dense.probe_batch_sizes([bf16]))
    packs = dense.can_prepack(bf16) or runner.widen and dense.can_prepack_widened(bf16)
    paths = {"reference", "native"} | ({"prepacked"} if packs else set())
    assert all(set(by_path) == paths and
               all(t > 0 for t in by_path.values()) for by_path in times.values())
    plan = dense.choose_plan(times)
    assert runner.linear_path == plan.name
    # row counts the plan gave elsewhere (or to no one) go native when the native decoder
    # won the whole-step timing that follows: it never takes rows from the plan's kernel
    if runner.skinny_rows == plan.skinny_rows:
        assert runner.plain_rows == plan.plain_rows
    else:
        assert runner.skinny_rows > plan.skinny_rows
        won = runner.decoder_probe[runner.skinny_rows]
        assert won["decoder"] < won["plan"]
        assert runner.plain_rows in (None, max(plan.plain_rows or 0, runner.skinny_rows))
    layers = [m for m in loaded.model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    assert all(layer.skinny_rows == runner.skinny_rows for layer in layers)
    assert all((layer.packed_weight is not None or layer.weight.is_mkldnn) == plan.prepack
               for layer in layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_prefetch_distance_changes_no_bits(dtype):
    """The one-row bodies read the same elements in the same order whatever they ask the
    memory for ahead; a negative distance is refused."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 768, generator=gen).to(dtype)
    weight = torch.randn(1000, 768, generator=gen).to(dtype)
    outputs = []
    try:
        for distance in (*native.ROW_PREFETCH_CHOICES, 64):
            native.set_row_prefetch(distance)
            outputs.append(native.skinny_linear(x, weight))
    finally:
        native.set_row_prefetch(native.ROW_PREFETCH_CHOICES[0])
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])
    with pytest.raises(ValueError, match="-1"):
        native.set_row_prefetch(-1)
    times = native.time_row_prefetch([weight], rounds=2)
    assert set(times) == set(native.ROW_PREFETCH_CHOICES) and all(t > 0 for t in times.values())


def test_the_runner_keeps_the_fastest_row_prefetch_where_the_build_takes_one(
        tiny_qwen3_tied_dir, monkeypatch):
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    monkeypatch.setenv("LLMQ_LINEAR_PATH", "auto")
    try:
        # NOTE: bf16 too: it never packs panels, so a build that tunes always times it
        for dtype in ("float32", "bfloat16"):
            runner = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype=dtype),
                                 kv_cache_bytes=1 << 20)
            if native.row_prefetch_tunable() and not runner.panel_weights:
                times = runner.row_prefetch_probe
                assert set(times) == set(native.ROW_PREFETCH_CHOICES)
                assert runner.row_prefetch == min(times, key=times.get)
            else:  # an AVX2 or plain build keeps its fixed distances, and fp32 weights in
                # panels (a plan the timing may pick) have their own prefetch: nothing timed
                assert runner.row_prefetch_probe == {} and runner.row_prefetch is None
        # a fixed path times nothing
        monkeypatch.setenv("LLMQ_LINEAR_PATH", "native")
        fixed = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                            kv_cache_bytes=1 << 20)
        assert fixed.row_prefetch_probe == {} and fixed.row_prefetch is None
    finally:
        native.set_row_prefetch(native.ROW_PREFETCH_CHOICES[0])


def test_the_panels_row_prefetch_changes_no_bits():
    """A one-row call on panels reads the same elements in the same order whatever it
    prefetches (the next panel, bytes ahead, nothing); calls of more rows do not read the
    setting; a value below NEXT_PANEL is refused."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(1000, 768, generator=gen)
    panels = native.pack_panels(weight)
    outputs: dict[int, list[torch.Tensor]] = {1: [], 5: []}
    try:
        for choice in (*native.PANEL_ROW_PREFETCH_CHOICES, 64, 1 << 20):
            native.set_panel_row_prefetch(choice)
            for rows, got in outputs.items():
                x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
                got.append(native.panel_linear(x, panels, 1000))
    finally:
        native.set_panel_row_prefetch(native.NEXT_PANEL)
    for got in outputs.values():
        assert all(torch.equal(out, got[0]) for out in got[1:])
    with pytest.raises(ValueError, match="-2"):
        native.set_panel_row_prefetch(-2)
    times = native.time_panel_row_prefetch([(panels, 1000)], rounds=2)
    assert set(times) == set(native.PANEL_ROW_PREFETCH_CHOICES) and all(
        t > 0 for t in times.values())


def test_reading_panels_side_by_side_changes_no_bits():
    """A call of up to 4 rows reads 1..8 panels at once as set, each output the same sum
    in the same order (with or without a prefetch, with a bias, threads holding fewer
    panels than streams, a last panel past the weight's rows); calls of more rows are
    unchanged; 0 and 9 are refused."""
    gen = torch.Generator().manual_seed(12)
    weight, bias = torch.randn(1000, 768, generator=gen), torch.randn(1000, generator=gen)
    small = torch.randn(70, 300, generator=gen)  # 3 panels (AVX-512): fewer than streams
    packed, packed_small = native.pack_panels(weight), native.pack_panels(small)
    xs = [torch.randn(rows, 768, generator=gen)
          for rows in range(1, native.PANEL_STREAM_ROWS + 2)]
    x_small = torch.randn(2, 300, generator=gen)

    def calls() -> list[torch.Tensor]:
        return ([native.panel_linear(x, packed, 1000, bias) for x in xs]
                + [native.panel_linear(x_small, packed_small, 70)])

    want = calls()
    for x, out in zip(xs, want):
        assert torch.allclose(out, x @ weight.T + bias, atol=1e-4)
    try:
        for streams in range(1, native.MAX_PANEL_ROW_STREAMS + 1):
            for prefetch in (native.NEXT_PANEL, 0, 2048):
                native.set_panel_row_streams(streams)
                native.set_panel_row_prefetch(prefetch)
                got = calls()
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (streams, prefetch)
        for bad in (0, native.MAX_PANEL_ROW_STREAMS + 1):
            with pytest.raises(ValueError, match=str(bad)):
                native.set_panel_row_streams(bad)
        times = native.time_panel_row_streams([(packed, 1000)], rounds=2)
        assert set(times) == set(native.PANEL_ROW_STREAMS_CHOICES) and all(
            t > 0 for t in times.values())
    finally:
        native.set_panel_row_streams(1)
        native.set_panel_row_prefetch(native.NEXT_PANEL)


def test_reading_bf16_weight_rows_side_by_side_changes_no_bits():
    """A one-row bf16 call on an AVX2 build reads 1..3 weight rows at once as set, each
    output the same sum in the same order (with a bias, a K with a tail past the 16- and
    32-weight steps, threads holding fewer rows than streams); calls of more rows are
    unchanged; 0 and 4 are refused. (Other builds take the setting and read one.)"""
    gen = torch.Generator().manual_seed(13)
    shapes = ((1000, 768), (997, 775), (5, 40), (2, 300))
    weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for n, k in shapes]
    biases = [torch.randn(n, generator=gen).to(torch.bfloat16) for n, _ in shapes]
    xs = [torch.randn(rows, k, generator=gen).to(torch.bfloat16)
          for _, k in shapes for rows in (1, 3)]

    def calls() -> list[torch.Tensor]:
        return [native.skinny_linear(x, w, b) for x, (w, b) in zip(
            xs, [pair for pair in zip(weights, biases) for _ in (1, 3)])]

    # rows whose sum depends on the order its partial sums are added in (bf16 outputs
    # round most other differences away): 2^26 and -2^26 in the first two sums a step
    # holds, 1 in the third; added as the AVX2 one-row body adds them, 1; otherwise 0
    # (the other builds' bodies add in another order, the same for every setting)
    crafted = torch.zeros(1000, 768)
    for row in (0, 1, 333, 500, 666, 998, 999):
        crafted[row, 0], crafted[row, 1], crafted[row, 16] = 2.0 ** 26, -(2.0 ** 26), 1.0
    crafted = crafted.to(torch.bfloat16)
    ones = torch.ones(1, 768, dtype=torch.bfloat16)
    want = calls()
    for x, w, b, out in zip(xs[::2], weights, biases, want[::2]):
        ref = x.float() @ w.float().T + b.float()
        assert torch.allclose(out.float(), ref, atol=0.05, rtol=0.02)
    want_crafted = native.skinny_linear(ones, crafted)
    if native.row_streams_tunable():
        assert want_crafted[0, [0, 1, 333, 500, 666, 998, 999]].tolist() == [1.0] * 7
    try:
        for streams in range(1, native.MAX_ROW_STREAMS + 1):
            native.set_row_streams(streams)
            got = calls()
            assert all(torch.equal(a, b) for a, b in zip(got, want)), streams
            assert torch.equal(native.skinny_linear(ones, crafted), want_crafted), streams
        for bad in (0, native.MAX_ROW_STREAMS + 1):
            with pytest.raises(ValueError, match=str(bad)):
                native.set_row_streams(bad)
        times = native.time_row_streams(weights[:1], rounds=2)
        assert set(times) == set(native.ROW_STREAMS_CHOICES) and all(
            t > 0 for t in times.values())
    finally:
        native.set_row_streams(1)


def test_the_runner_keeps_the_fastest_bf16_row_streams(tiny_qwen3_tied_dir, monkeypatch):
    """On an AVX2 build (this CPU's, or the x86-64-v3 build) `auto` times one-row passes
    over the bf16 weights per number of rows read at once and keeps the fastest; fp32
    weights (in panels), a fixed path or another build: nothing."""
    import platform

    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    if native.isa() != "avx2":
        if platform.machine() != "x86_64":
            pytest.skip("the baseline builds are for x86_64")
        baseline = native.build("x86-64-v3")
        assert baseline is not None
        monkeypatch.setattr(native, "_library", lambda: baseline)
    monkeypatch.setenv("LLMQ_LINEAR_PATH", "auto")
    chosen = []
    monkeypatch.setattr(native, "set_row_streams",
                        lambda n, set_=native.set_row_streams: (chosen.append(n), set_(n)))
    try:
        bf16 = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="bfloat16"),
                           kv_cache_bytes=1 << 20)
        times = bf16.row_streams_probe
        assert set(times) == set(native.ROW_STREAMS_CHOICES)
        assert bf16.row_streams == min(times, key=times.get) == chosen[-1]
        fp32 = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                           kv_cache_bytes=1 << 20)
        assert fp32.row_streams_probe == {} and fp32.row_streams is None
        monkeypatch.setenv("LLMQ_LINEAR_PATH", "native")
        fixed = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="bfloat16"),
                            kv_cache_bytes=1 << 20)
        assert fixed.row_streams_probe == {} and fixed.row_streams is None
    finally:
        native.set_row_streams(1)


def test_the_runner_keeps_the_fastest_panel_row_prefetch(tiny_qwen3_tied_dir, monkeypatch):
    """With fp32 weights in panels, `auto` times one-row passes on them per way of
    prefetching and keeps the fastest; without panels, or on a fixed path, nothing."""
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    monkeypatch.setenv("LLMQ_LINEAR_PATH", "auto")
    chosen, chosen_streams = [], []
    monkeypatch.setattr(native, "set_panel_row_prefetch",
                        lambda n, set_=native.set_panel_row_prefetch: (chosen.append(n),
                                                                       set_(n)))
    monkeypatch.setattr(native, "set_panel_row_streams",
                        lambda n, set_=native.set_panel_row_streams: (
                            chosen_streams.append(n), set_(n)))
    try:
        runner = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                             kv_cache_bytes=1 << 20)
        if runner.panel_weights:
            times = runner.panel_prefetch_probe
            assert set(times) == set(native.PANEL_ROW_PREFETCH_CHOICES)
            assert runner.panel_row_prefetch == min(times, key=times.get) == chosen[-1]
            streams = runner.panel_streams_probe
            assert set(streams) == set(native.PANEL_ROW_STREAMS_CHOICES)
            assert runner.panel_row_streams == min(streams, key=streams.get) == (
                chosen_streams[-1])
        else:
            assert runner.panel_prefetch_probe == {} and runner.panel_row_prefetch is None
            assert runner.panel_streams_probe == {} and runner.panel_row_streams is None
        bf16 = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="bfloat16"),
                           kv_cache_bytes=1 << 20)
        assert not bf16.panel_weights and bf16.panel_prefetch_probe == {}
        assert bf16.panel_streams_probe == {}
        monkeypatch.setenv("LLMQ_LINEAR_PATH", "native")
        fixed = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                            kv_cache_bytes=1 << 20)
        assert fixed.panel_prefetch_probe == {} and fixed.panel_row_prefetch is None
        assert fixed.panel_streams_probe == {} and fixed.panel_row_streams is None
    finally:
        native.set_panel_row_prefetch(native.NEXT_PANEL)
        native.set_panel_row_streams(1)


def test_without_a_compiler_the_native_path_falls_back_to_prepacked(tmp_path,
                                                                    tiny_qwen3_tied_dir):
    """A machine with no C compiler: the build fails, the reason is logged, `native` asked
    for by name runs prepacked and the timing compares only torch's paths."""
    script = f"""
import json, logging
logging.basicConfig(level=logging.WARNING)
from kernels import native
from workers.engine.loader import load_checkpoint
from workers.engine.model_runner import ModelRunner
loaded = load_checkpoint({str(tiny_qwen3_tied_dir)!r}, dtype="float32")
named = ModelRunner(loaded, kv_cache_bytes=1 << 20, linear_path="native")
timed = ModelRunner(load_checkpoint({str(tiny_qwen3_tied_dir)!r}, dtype="float32"),
                    kv_cache_bytes=1 << 20, linear_path="auto")
print(json.dumps([native.available(), named.linear_path,
                  sorted({{p for t in timed.linear_probe.values() for p in t}})]))
"""
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"),
           "LLMQ_KERNEL_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr
    available, path, probed = json.loads(result.stdout.strip().splitlines()[-1])
    assert (available, path, probed) == (False, "prepacked", ["prepacked", "reference"])
    assert "native CPU kernel unavailable" in result.stderr


def test_builds_are_kept_per_cpu_and_source(tmp_path):
    """The build lands in the cache under a name hashed from source, flags and CPU, and a
    second process loads it without compiling."""
    script = """
import json
from kernels import native
print(json.dumps([native.available(), str(native._library().path)]))
"""
    env = {**os.environ, "LLMQ_KERNEL_CACHE": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=180, cwd=root)
    assert first.returncode == 0, first.stderr
    available, path = json.loads(first.stdout.strip().splitlines()[-1])
    assert available and os.path.dirname(path) == str(tmp_path)
    built = os.stat(path).st_mtime_ns
    again = subprocess.run([sys.executable, "-c", script],
                           env={**env, "CC": str(tmp_path / "no-such-compiler")},
                           capture_output=True, text=True, timeout=180, cwd=root)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1]) == [True, path]
    assert os.stat(path).st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]  # no leftovers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_ops_equal_the_references(dtype):
    """bf16: bit for bit (the same roundings at the same points); fp32: within a few ulp
    (sums in another order, another exp)."""
    from kernels import activation, norms, rotary

    gen = torch.Generator().manual_seed(3)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    qkv = rand(5, 12 * 64 + 2 * 4 * 64, scale=3)
    q = qkv[:, :768].view(5, 12, 64)  # token rows strided by the qkv width
    k = qkv[:, 768:1024].view(5, 4, 64)
    cos_sin = rand(5, 64)
    x, residual, weight = rand(5, 768), rand(5, 768), rand(768)
    cos, sin = cos_sin.chunk(2, dim=-1)  # views with a row stride of 64
    gate_up = rand(5, 2 * 1000, scale=6)
    gate_up[0, :6] = torch.tensor([100.0, -100.0, 90.0, -90.0, 0.0, float("nan")])
    pairs = [
        (native.rms_norm(x, weight, 1e-6), norms.rms_norm(x, weight, 1e-6)),
        (native.rms_norm(q, weight[:64], 1e-6), norms.rms_norm(q, weight[:64], 1e-6)),
        *zip(native.fused_add_rms_norm(x, residual, weight, 1e-5),
             norms.fused_add_rms_norm(x, residual, weight, 1e-5)),
        *zip(native.apply_rotary(q, k, cos, sin), rotary.apply_rotary(q, k, cos, sin)),
        (native.silu_and_mul(gate_up), activation.silu_and_mul(gate_up)),
    ]
    for got, want in pairs:
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        if dtype == torch.bfloat16:
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
        else:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_and_the_kv_store_equal_the_references(dtype):
    """A mixed step: a fresh prompt, a chunk after a cached prefix and decodes of several
    lengths (one of a single key); keys stored through the native store, read straight
    from the cache blocks by the native decode."""
    import random

    from kernels import attention
    from kernels.attention import build_attention_metadata

    gen = torch.Generator().manual_seed(11)
    block_size, num_layers, layer = 4, 3, 1
    kv_cache = torch.randn(64, 2, num_layers, block_size, 2, 16, generator=gen).to(dtype)
    reference_cache = kv_cache.clone()
    free = list(range(64))
    random.Random(11).shuffle(free)
    # (tokens already cached, new tokens): a fresh prompt, a chunk, then decodes
    shapes = [(0, 6), (9, 3), (29, 1), (0, 1), (12, 1), (70 - 1, 1)]
    spans = [(start, n, [free.pop() for _ in range(-(-(start + n) // block_size))])
             for start, n in shapes]
    num_tokens = sum(n for _, n in shapes)
    q = torch.randn(num_tokens, 8, 16, generator=gen).to(dtype)
    kv = torch.randn(num_tokens, 2 * 2 * 16 + 5, generator=gen).to(dtype)
    k = kv[:, :32].view(num_tokens, 2, 16)  # token rows strided by 37
    v = kv[:, 32:64].view(num_tokens, 2, 16)
    outs = []
    for cache, store, attend in ((kv_cache, native.store_kv, native.paged_attention),
                                 (reference_cache, attention.store_kv,
                                  attention.paged_attention)):
        meta = build_attention_metadata(cache, spans)
        k_cache, v_cache = cache[:, 0, layer], cache[:, 1, layer]
        store(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
        outs.append(attend(q, k, v, k_cache, v_cache, meta))
    assert torch.equal(kv_cache, reference_cache)  # the same slots written, nothing else
    got, want = outs
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_decode_attention_shares_uneven_contexts_between_threads(threads):
    """The threads split the decodes by their keys, not by count: one long context among
    short ones, more threads than some sequences' heads, a single decode. Every
    (sequence, KV head) is computed once, whatever the split: the outputs equal the
    reference's and the one-thread call's bit for bit."""
    import random

    from kernels import attention
    from kernels.attention import build_attention_metadata

    gen = torch.Generator().manual_seed(threads)
    block_size = 4
    cache = torch.randn(200, 2, 1, block_size, 2, 16, generator=gen)
    free = list(range(200))
    random.Random(threads).shuffle(free)
    k_cache, v_cache = cache[:, 0, 0], cache[:, 1, 0]
    for lengths in ((300, 3, 5, 1, 7, 2, 9), (1,), (17, 2), tuple(range(1, 30))):
        spans = [(n - 1, 1, [free[(i * 37 + j) % 200] for j in range(-(-n // block_size))])
                 for i, n in enumerate(lengths)]
        q = torch.randn(len(lengths), 6, 16, generator=gen)
        kv = torch.zeros(len(lengths), 2, 16)
        meta = build_attention_metadata(cache, spans)
        old = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = native.paged_attention(q, kv, kv, k_cache, v_cache, meta)
            torch.set_num_threads(threads)
            shared = native.paged_attention(q, kv, kv, k_cache, v_cache, meta)
        finally:
            torch.set_num_threads(old)
        want = attention.paged_attention(q, kv, kv, k_cache, v_cache, meta)
        assert torch.equal(shared, alone), lengths
        assert torch.allclose(shared, want, rtol=1e-5, atol=1e-6), lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_of_every_head_size_equals_the_avx2_build_bit_for_bit(
        monkeypatch, dtype):
    """Decodes over 1 to 40 keys (16 at a time in the AVX-512 build's scores, with
    tails), 1 to 3 query heads a KV head, head sizes of one to eight 16-lane vectors and
    one of none (48: the plain loops): the same bits as the x86-64-v3 build's AVX2 form,
    and the reference's (bf16: equal; fp32: within rounding)."""
    import platform
    import random

    from kernels import attention
    from kernels.attention import build_attention_metadata

    if platform.machine() != "x86_64":
        pytest.skip("the baseline build is for x86_64")
    builds = [native.build("native"), native.build("x86-64-v3")]
    assert all(builds)
    for head_dim, group in ((16, 3), (32, 1), (64, 3), (128, 2), (48, 2)):
        gen = torch.Generator().manual_seed(head_dim + group)
        block_size, kv_heads = 4, 2
        cache = torch.randn(64, 2, 1, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        free = list(range(64))
        random.Random(head_dim).shuffle(free)
        spans = [(n - 1, 1, [free.pop() for _ in range(-(-n // block_size))])
                 for n in (1, 15, 16, 17, 40)]
        q = torch.randn(len(spans), kv_heads * group, head_dim, generator=gen).to(dtype)
        kv = torch.zeros(len(spans), kv_heads, head_dim, dtype=dtype)
        meta = build_attention_metadata(cache, spans)
        k_cache, v_cache = cache[:, 0, 0], cache[:, 1, 0]
        outs = []
        for build in builds:
            monkeypatch.setattr(native, "_library", lambda build=build: build)
            outs.append(native.paged_attention(q, kv, kv, k_cache, v_cache, meta))
        want = attention.paged_attention(q, kv, kv, k_cache, v_cache, meta)
        assert torch.equal(outs[0], outs[1]), (head_dim, group)
        if dtype == torch.bfloat16:
            assert torch.equal(outs[0], want), (head_dim, group)
        else:
            assert torch.allclose(outs[0], want, rtol=1e-5, atol=1e-6), (head_dim, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_prompt_chunks_attended_as_decode_rows_equal_the_chunk_path(dtype):
    """`chunks_as_decodes`: short chunks (a fresh prompt, a chunk after a cached prefix)
    join the decodes one query per row; a longer one stays a chunk. Native and reference
    decodes of those rows agree with the chunk path's attention."""
    import random

    from kernels import attention
    from kernels.attention import build_attention_metadata

    gen = torch.Generator().manual_seed(5)
    block_size, layer = 4, 0
    kv_cache = torch.randn(80, 2, 1, block_size, 2, 16, generator=gen).to(dtype)
    free = list(range(80))
    random.Random(5).shuffle(free)
    shapes = [(0, 6), (9, 3), (13, 1), (0, 20), (5, 8), (40, 1)]
    spans = [(start, n, [free.pop() for _ in range(-(-(start + n) // block_size))])
             for start, n in shapes]
    num_tokens = sum(n for _, n in shapes)
    q = torch.randn(num_tokens, 8, 16, generator=gen).to(dtype)
    k = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)
    v = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)
    k_cache, v_cache = kv_cache[:, 0, layer], kv_cache[:, 1, layer]
    as_chunks = build_attention_metadata(kv_cache, spans)
    as_rows = build_attention_metadata(kv_cache, spans, chunks_as_decodes=8)
    assert [(c.token_start, c.num_tokens) for c in as_rows.chunks] == [(10, 20)]
    assert as_rows.decodes.context_lens == [1, 2, 3, 4, 5, 6, 10, 11, 12, 14,
                                            6, 7, 8, 9, 10, 11, 12, 13, 41]
    attention.store_kv(k, v, k_cache, v_cache, as_chunks.slot_blocks, as_chunks.slot_offsets)
    want = attention.paged_attention(q, k, v, k_cache, v_cache, as_chunks).float()
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else \
        {"rtol": 0.02, "atol": 0.02}
    for attend in (native.paged_attention, attention.paged_attention):
        got = attend(q, k, v, k_cache, v_cache, as_rows).float()
        assert torch.allclose(got, want, **tolerance), (got - want).abs().max()


def test_inputs_the_step_ops_do_not_take_go_to_the_references():
    """fp16 (no native form) and mixed dtypes give the reference's results."""
    from kernels import activation, norms

    x = torch.randn(3, 64).half()
    assert torch.equal(native.rms_norm(x, torch.ones(64).half(), 1e-6),
                       norms.rms_norm(x, torch.ones(64).half(), 1e-6))
    assert torch.equal(native.rms_norm(x.float(), torch.ones(64).bfloat16(), 1e-6),
                       norms.rms_norm(x.float(), torch.ones(64).bfloat16(), 1e-6))
    assert torch.equal(native.silu_and_mul(x), activation.silu_and_mul(x))


def test_the_step_kernels_setting_picks_native_or_reference(tiny_qwen3_tied_dir, monkeypatch):
    from kernels import dispatch, norms
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    for value, fn in (("reference", norms.rms_norm), ("native", native.rms_norm)):
        monkeypatch.setenv("LLMQ_CPU_KERNELS", value)
        runner = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                             kv_cache_bytes=1 << 20, linear_path="reference")
        assert runner.step_kernels == value and dispatch.get("rms_norm", "cpu") is fn
    monkeypatch.setenv("LLMQ_CPU_KERNELS", "fastest")
    with pytest.raises(ValueError, match="LLMQ_CPU_KERNELS='fastest'"):
        ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                    kv_cache_bytes=1 << 20, linear_path="reference")


@pytest.mark.parametrize("march, isa", [("x86-64-v4", "avx512f"), ("x86-64-v3", "avx2"),
                                        ("x86-64", "generic")])
def test_the_builds_for_other_x86_cpus_equal_the_references(monkeypatch, march, isa):
    """The same checks on builds for x86-64-v4 (AVX-512 without BF16: bf16 weights widened
    as they stream in), x86-64-v3 (AVX2 and FMA, no AVX-512: the vector bodies such a CPU
    runs) and plain x86-64 (the plain loops), which the native build of a CPU with bf16
    dot products (or without AVX-512) never runs."""
    import platform

    from kernels.cpu import cpu_flags

    if platform.machine() != "x86_64":
        pytest.skip("the baseline builds are for x86_64")
    if march == "x86-64-v4" and not {"avx512f", "avx512bw", "avx512dq",
                                     "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU cannot run an AVX-512 build")
    baseline = native.build(march)
    assert baseline is not None and baseline.isa == isa
    monkeypatch.setattr(native, "_library", lambda: baseline)
    if isa == "generic":  # the plain loops of the panels are not offered as a path
        assert not native.panels_supported(torch.empty(2, 2))
        monkeypatch.setattr(native, "PANEL_ISAS", (*native.PANEL_ISAS, "generic"))
    for shape in ((1, 7, 5), (5, 100, 768), (13, 97, 48), (25, 130, 96), (70, 65, 40)):
        test_panels_equal_the_exact_product(*shape)
    test_reading_panels_side_by_side_changes_no_bits()
    test_reading_bf16_weight_rows_side_by_side_changes_no_bits()
    for dtype in (torch.float32, torch.bfloat16):
        test_the_step_ops_equal_the_references(dtype)
        test_decode_attention_and_the_kv_store_equal_the_references(dtype)
        test_short_prompt_chunks_attended_as_decode_rows_equal_the_chunk_path(dtype)
        for shape in ((1, 7, 5), (5, 100, 768), (9, 256, 200), (3, 33, 25), (1, 9, 59),
                      (13, 97, 48)):
            test_the_kernel_equals_torch_linear_within_the_summation_order(dtype, *shape)


def _step_logits(runner, steps) -> list[torch.Tensor]:
    """The logits of every row of each step, from a cleared KV cache."""
    from tasks.params import SamplingParams
    from workers.engine.step_io import ScheduledSequence, SchedulerOutput

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    runner.kv_cache.zero_()
    logits = []
    for step in steps:
        scheduled = [ScheduledSequence(seq_id=i, token_ids=tokens, start_pos=start,
                                       block_table=list(range(24 * i, 24 * i + 24)), sample=True,
                                       params=params, prompt_token_ids=[], output_token_ids=[])
                     for i, start, tokens in step]
        logits.append(runner.forward_logits(
            SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled))))
    return logits


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_decode_steps_in_one_native_call_equal_the_layer_loop_bit_for_bit(
        arch, dtype, march, request, monkeypatch):
    """The decode steps the native decoder takes (every row a decode, at most its rows)
    give exactly the layer-by-layer path's logits: Qwen3's per-head norms, Qwen2's QKV
    bias, Llama's plain layers; prompts and steps of more rows stay on the layer loop.
    Also on the AVX2 build (x86-64-v3), which an AVX-512 machine never runs otherwise."""
    import platform

    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import NATIVE_ROWS, ModelRunner

    if march != "native":
        if platform.machine() != "x86_64":
            pytest.skip("the baseline builds are for x86_64")
        baseline = native.build(march)
        assert baseline is not None
        monkeypatch.setattr(native, "_library", lambda: baseline)
    monkeypatch.setenv("LLMQ_CPU_KERNELS", "native")
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    runner = ModelRunner(load_checkpoint(model_dir, dtype=dtype), block_size=4,
                         kv_cache_bytes=8 << 20, linear_path="native")
    decoder = runner.model.model.native_decoder
    assert runner.decoder_rows == NATIVE_ROWS and decoder is not None
    # fp32 projections on their panels, in the layer loop and in the decoder alike
    assert bool(runner.panel_weights) == (dtype == "float32") == bool(decoder._shape.panels)
    calls = []
    monkeypatch.setattr(type(decoder), "takes", lambda self, hidden, meta, takes=type(
        decoder).takes: calls.append(takes(self, hidden, meta)) or calls[-1])
    prompts = [[5, 9, 13, 2, 7, 30, 41, 8, 3], [11, 4, 6], [8] * 70]
    steps = [[(i, 0, p) for i, p in enumerate(prompts)]]  # 82 rows: the layer loop
    length = [len(p) for p in prompts]
    for rows in (3, 3, 2, 1, 1):  # decodes of 3, 2 and 1 rows: the native decoder
        steps.append([(i, length[i], [17 + i + length[i]]) for i in range(rows)])
        for i in range(rows):
            length[i] += 1
    fused = _step_logits(runner, steps)
    assert calls == [False, True, True, True, True, True]
    if dtype == "bfloat16" and native.isa() == "avx2":
        # the one-row steps with their bf16 weight rows read three at a time: the same
        try:
            native.set_row_streams(native.MAX_ROW_STREAMS)
            side_by_side = _step_logits(runner, steps)
        finally:
            native.set_row_streams(1)
        for step, (a, b) in enumerate(zip(fused, side_by_side)):
            assert torch.equal(a, b), f"step {step}, rows side by side: {(a - b).abs().max()}"
    runner.model.model.native_decoder = None
    loop = _step_logits(runner, steps)
    for step, (a, b) in enumerate(zip(fused, loop)):
        assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_weights_the_native_kernel_takes_live_in_panels(tied, request, monkeypatch):
    """With the native kernel up to 4 rows and oneDNN's packed copies above, an fp32
    projection's weight is kept in panels for the native calls and its plain copy is freed
    (no call reaches it); an LM head tied to the input embedding frees it too, and the
    embedding's lookups read the head's panels, the same rows bit for bit. A call of each
    row count goes to the path the plan names, with the exact product."""
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import NATIVE_ROWS, ModelRunner
    from workers.engine.models.layers import LinearBase, ParallelLMHead, native_rows

    loaded = load_checkpoint(request.getfixturevalue(
        "tiny_qwen3_tied_dir" if tied else "tiny_qwen3_dir"), dtype="float32")
    plain = {name: m.weight.clone() for name, m in loaded.model.named_modules()
             if isinstance(m, LinearBase | ParallelLMHead)}
    embedding = loaded.model.model.embed_tokens
    table = embedding.weight.clone()
    runner = ModelRunner(loaded, kv_cache_bytes=1 << 20, linear_path="native")
    assert runner.panel_weights == len(plain) and runner.plain_rows is None
    calls = []
    monkeypatch.setattr(native, "panel_linear", lambda *a, f=native.panel_linear, **k:
                        calls.append("panels") or f(*a, **k))
    for name, module in loaded.model.named_modules():
        if not isinstance(module, LinearBase | ParallelLMHead):
            continue
        assert module.panel_weight is not None and native_rows(module) == NATIVE_ROWS
        assert module.weight.is_mkldnn and module.packed_weight is None
        for rows in (1, NATIVE_ROWS, NATIVE_ROWS + 1):
            calls.clear()
            x = torch.randn(rows, plain[name].shape[1])
            got = (module(x) if isinstance(module, LinearBase) else module.compute_logits(x))
            got = got[0] if isinstance(got, tuple) else got
            exact = F.linear(x.double(), plain[name].double(),
                             None if getattr(module, "bias", None) is None
                             else module.bias.double())
            assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4)
            assert calls == (["panels"] if rows <= NATIVE_ROWS else [])
    # the lookups: from the head's panels (tied; no plain table left), else the table
    assert (embedding.lookup_panels is loaded.model.lm_head.panel_weight) is tied
    assert ("weight" in embedding._parameters) is not tied
    ids = torch.tensor([[0, 5, table.shape[0] - 1], [17, 16, 15]])
    assert torch.equal(embedding(ids), table[ids])
    # plain [vocab, hidden] tensors left: the untied embedding's table alone
    assert sum(t.shape == table.shape and not t.is_mkldnn for t in [
        *loaded.model.parameters(), *loaded.model.buffers()]) == (not tied)


def test_the_runner_gives_the_native_decoder_the_row_counts_where_whole_steps_run_faster(
        tiny_qwen3_tied_dir, monkeypatch):
    """After the plan, whole decode steps of 1, 2, 4, ... rows are timed on the plan's
    paths and with the native decoder; it takes the row counts where it is faster, up to
    the first where it is not, the native kernel the same rows (a split's plain weight
    reaching them), and the steps' KV writes are cleared."""
    from kernels import timing
    from workers.engine import model_runner
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner
    from workers.engine.models.layers import LinearBase

    monkeypatch.setenv("LLMQ_CPU_KERNELS", "native")
    # the decoder's own row counts past the linear probe's (32, 64) are weighed too
    for decoder_wins_to, rows in ((4, 4), (0, 0), (32, 32), (64, 64)):
        runner = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                             kv_cache_bytes=1 << 20, linear_path="split")
        assert runner.decoder_rows == 0 and runner.decoder_probe == {}  # fixed: no timing
        layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
        assert all(layer.plain_rows == 1 and layer.skinny_rows == 0 for layer in layers)
        runner.linear_probe = {m: {"reference": 1.0, "prepacked": 1.0, "native": 1.0}
                               for m in dense.PROBE_BATCH_SIZES}

        # NOTE: a clock of our own that each step moves by what it should cost: with
        # sleeps on the real clock, a stalled host made a losing step win
        clock = [0.0]

        def timed(step, runner=runner, forward=runner.forward_logits, wins_to=decoder_wins_to,
                  clock=clock):
            decoder = runner.model.model.native_decoder
            rows = len(step.scheduled)
            on_decoder = decoder is not None and rows <= decoder.max_rows
            logits = forward(step)
            clock[0] += 0.002 if on_decoder == (rows <= wins_to) else 0.02
            return logits

        monkeypatch.setattr(runner, "forward_logits", timed)
        fake_time = types.SimpleNamespace(perf_counter=lambda clock=clock: clock[0])
        monkeypatch.setattr(model_runner, "time", fake_time)
        monkeypatch.setattr(timing, "time", fake_time)  # alternated_medians' clock
        runner._weigh_native_decoder(runner.model.use_native_decoder)
        probed = [1, 2, 4, 8, 16, 32, 64]
        assert list(runner.decoder_probe) == (probed[:probed.index(rows) + 2] if rows
                                              else [1])
        assert runner.decoder_rows == runner.skinny_rows == rows
        assert (runner.model.model.native_decoder is not None) == bool(rows)
        assert all(layer.skinny_rows == rows and layer.plain_rows == max(1, rows)
                   for layer in layers)
        assert not runner.kv_cache.any()


def test_a_model_without_the_native_decoder_keeps_the_plans_native_rows(
        tiny_qwen3_tied_dir, monkeypatch):
    """Where the decoder cannot run (here: the model declines it), weighing it leaves the
    plan as it was: the native kernel keeps the rows the plan gave it."""
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import NATIVE_ROWS, ModelRunner
    from workers.engine.models.layers import LinearBase

    monkeypatch.setenv("LLMQ_CPU_KERNELS", "native")
    runner = ModelRunner(load_checkpoint(tiny_qwen3_tied_dir, dtype="float32"),
                         kv_cache_bytes=1 << 20, linear_path="native")
    runner.linear_probe = {m: {"reference": 1.0, "prepacked": 1.0, "native": 1.0}
                           for m in dense.PROBE_BATCH_SIZES}
    runner.decoder_rows = 0
    runner._weigh_native_decoder(lambda rows: 0)
    layers = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert runner.skinny_rows == NATIVE_ROWS and runner.decoder_rows == 0
    assert all(layer.skinny_rows == NATIVE_ROWS for layer in layers)
    assert runner.decoder_probe == {}


def test_the_native_decoder_gives_its_step_up_when_its_stop_flag_is_set(tiny_qwen3_dir):
    """`NativeDecoder(..., stop, stop_before)`: a set flag stops the call before the first
    layer it reads it at (DecoderStopped), `stop_before` 0 never reads it, and a clear
    flag changes nothing: the same outputs as a call without one."""
    from kernels.attention import build_attention_metadata
    from workers.engine.loader import load_checkpoint
    from workers.engine.model_runner import ModelRunner

    runner = ModelRunner(load_checkpoint(tiny_qwen3_dir, dtype="float32"),
                         kv_cache_bytes=1 << 20, linear_path="native")
    model = runner.model.model
    assert runner.model.use_native_decoder(4) == 4
    decoder = model.native_decoder
    spans = [(3, 1, [0]), (5, 1, [1])]
    meta = build_attention_metadata(runner.kv_cache, spans)
    hidden = model.embed_tokens(torch.tensor([7, 9]))
    cos, sin = model.rotary_emb(torch.tensor([3, 5]), hidden.dtype)
    want = decoder(hidden, cos, sin, meta)
    flag = native.StopFlag()
    got = decoder(hidden, cos, sin, meta, flag, runner.loaded.config.num_layers)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    flag.set()
    with pytest.raises(native.DecoderStopped) as stopped:
        decoder(hidden, cos, sin, meta, flag, runner.loaded.config.num_layers)
    assert stopped.value.layer == 0
    got = decoder(hidden, cos, sin, meta, flag, 0)  # reads it before no layer
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_native_decoder_refuses_layers_without_a_required_part():
    """A layer without one of the parts every layer needs is a ValueError naming it (the
    model then keeps its layer loop), layer 0's qkv included."""
    hidden, heads, head_dim, inter = 32, 4, 8, 64
    full: dict[str, torch.Tensor | None] = {
        "input_norm": torch.ones(hidden), "qkv": torch.zeros(3 * heads * head_dim, hidden),
        "o": torch.zeros(hidden, heads * head_dim), "post_norm": torch.ones(hidden),
        "gate_up": torch.zeros(2 * inter, hidden), "down": torch.zeros(hidden, inter)}
    for name in ("qkv", "o", "down"):
        layer = {**full, name: None}
        with pytest.raises(ValueError, match=name):
            native.NativeDecoder([layer], heads=heads, kv_heads=heads, head_dim=head_dim,
                                 eps=1e-6, max_rows=4)


def test_without_a_home_directory_the_native_kernel_is_left_out(monkeypatch, caplog):
    """A user without a home directory (an unnamed uid in a container) and no
    LLMQ_KERNEL_CACHE: the kernel is not built anywhere else (a shared directory could
    hand it another user's library), the start goes on without it, and says why."""
    import logging
    from pathlib import Path

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv(native.CACHE_ENV, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert native.cache_dir() is None
    with caplog.at_level(logging.WARNING, logger="kernels.native"):
        assert native.build.__wrapped__("native") is None
    assert "no home directory" in caplog.text and native.CACHE_ENV in caplog.text
