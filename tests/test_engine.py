"""The engine on the tiny Qwen3 checkpoint (fp32): continuous batching changes nothing
about what a greedy request produces, whatever else runs, preemption included."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tasks.params import SamplingParams
from workers.engine.builder import build_engine
from workers.engine.core import Engine, EngineConfig, PromptTooLongError
from workers.engine.outputs import CompletionDelta, FinishReason

# tiny preset, fp32: 2 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes x 16 tokens
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 4 * 16


def make_engine(model_dir: Path, num_blocks: int = 256, **config: object) -> Engine:
    return build_engine(
        str(model_dir),
        dtype="float32",
        kv_cache_bytes=num_blocks * BYTES_PER_BLOCK,
        config=EngineConfig(**config),  # type: ignore[arg-type]
    )


def run_all(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]):
    """Step until done, adding requests at their arrival steps; returns per-request results."""
    tokens: dict[str, dict[int, list[int]]] = {}
    texts: dict[str, dict[int, str]] = {}
    finals: dict[str, dict[int, CompletionDelta]] = {}
    step = 0
    while engine.has_unfinished_requests() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params)
            tokens[request_id] = {i: [] for i in range(params.n)}
            texts[request_id] = {i: "" for i in range(params.n)}
        for delta in engine.step():
            tokens[delta.request_id][delta.index] += delta.new_token_ids
            texts[delta.request_id][delta.index] += delta.text
            if delta.finished:
                finals.setdefault(delta.request_id, {})[delta.index] = delta
        step += 1
    return tokens, texts, finals


def assert_engine_empty(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.num_running == engine.num_waiting == 0
    assert engine.kv_manager.num_free_blocks == engine.num_blocks
    assert not engine.scheduler.seqs and not engine.scheduler.deferred
    assert not engine.kv_manager._seqs
    assert not engine._requests


def test_mixed_batch_with_preemption_matches_each_request_alone(tiny_qwen3_dir: Path) -> None:
    rng = random.Random(1234)
    requests = []
    for i in range(64):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 64))]
        params = SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0)
        requests.append((f"req{i}", prompt, params, rng.randint(0, 30)))
    # 32 blocks of 16 tokens for up to 64 sequences of up to 80 tokens: forces preemption
    engine = make_engine(
        tiny_qwen3_dir,
        num_blocks=32,
        max_num_seqs=32,
        max_num_batched_tokens=96,
        long_prefill_token_threshold=40,
    )
    arrivals: dict[int, list] = {}
    for request_id, prompt, params, at in requests:
        arrivals.setdefault(at, []).append((request_id, prompt, params))
    tokens, _, finals = run_all(engine, arrivals)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.generation_tokens_total == sum(len(t[0]) for t in tokens.values())
    assert_engine_empty(engine)

    alone = make_engine(tiny_qwen3_dir, enable_prefix_caching=False)
    for request_id, prompt, params, _ in requests:
        ref, _, _ = run_all(alone, {0: [(request_id, prompt, params)]})
        assert tokens[request_id][0] == ref[request_id][0], request_id
        assert finals[request_id][0].num_output_tokens == len(ref[request_id][0])


def test_shared_prefix_hits_cache_with_same_output(tiny_qwen3_dir: Path) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(100)]
    first = prefix + [11, 12, 13]
    second = prefix + [21, 22]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        engine = make_engine(tiny_qwen3_dir, enable_prefix_caching=caching)
        run_all(engine, {0: [("a", first, params)]})
        tokens, _, finals = run_all(engine, {0: [("b", second, params)]})
        results[caching] = (tokens["b"][0], finals["b"][0].num_cached_tokens)
        assert_engine_empty(engine)
    assert results[True][1] == 96  # six full blocks of the shared 100-token prefix
    assert results[False][1] == 0
    assert results[True][0] == results[False][0]
    assert len(results[True][0]) == 12


def test_stop_string_spanning_tokens(tiny_qwen3_dir: Path) -> None:
    engine = make_engine(tiny_qwen3_dir)
    prompt = "The river runs past the old mill"
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    tokens, texts, _ = run_all(engine, {0: [("full", prompt, params)]})
    full_text, full_ids = texts["full"][0], tokens["full"][0]
    # a stop string made of the end of one token's text and the start of the next
    tok = engine.tokenizer
    stop = None
    for k in range(3, len(full_ids) - 1):
        head = tok.decode(full_ids[:k])
        nxt = tok.decode(full_ids[: k + 1])
        if len(nxt) - len(head) >= 2 and len(head) >= 2 and full_text.startswith(nxt):
            candidate = nxt[len(head) - 2 : len(head) + 2]
            if candidate.strip() and full_text.find(candidate) == len(head) - 2:
                stop = candidate
                break
    assert stop is not None, f"no token boundary to test in {full_text!r}"
    stopped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    _, texts, finals = run_all(engine, {0: [("stop", prompt, stopped)]})
    final = finals["stop"][0]
    assert final.finish_reason == FinishReason.STOP and final.stop_reason == stop
    assert texts["stop"][0] == full_text[: full_text.index(stop)]
    assert_engine_empty(engine)


def test_n_samples_with_seed(tiny_qwen3_dir: Path) -> None:
    engine = make_engine(tiny_qwen3_dir)
    prompt = list(range(40, 90))
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3, ignore_eos=True)
    first, _, finals = run_all(engine, {0: [("x", prompt, params)]})
    again, _, _ = run_all(engine, {0: [("y", prompt, params)]})
    single = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    alone, _, _ = run_all(engine, {0: [("z", prompt, single)]})
    samples = [first["x"][i] for i in range(3)]
    assert all(len(s) == 10 for s in samples)
    assert len({tuple(s) for s in samples}) == 3  # samples differ from one another
    assert [again["y"][i] for i in range(3)] == samples  # and repeat with the seed
    assert alone["z"][0] == samples[0]
    # samples 1 and 2 started from sample 0's cached prompt blocks (3 of 50 tokens)
    assert [finals["x"][i].num_cached_tokens for i in range(3)] == [0, 48, 48]
    assert_engine_empty(engine)


def test_prompt_too_long_and_bad_input(tiny_qwen3_dir: Path) -> None:
    engine = make_engine(tiny_qwen3_dir, max_model_len=64)
    assert engine.max_model_len == 64
    with pytest.raises(PromptTooLongError, match=r"60.*max_tokens is 10.*70 > max_model_len 64"):
        engine.add_request("long", list(range(3, 63)), SamplingParams(max_tokens=10))
    assert issubclass(PromptTooLongError, ValueError)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    engine.add_request("ok", list(range(3, 13)), SamplingParams(max_tokens=54))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [5], SamplingParams())
    assert not engine.abort_request("unknown")
    deltas = engine.abort_request("ok")
    assert [(d.index, d.finished, d.finish_reason) for d in deltas] == [
        (0, True, FinishReason.CANCELLED)
    ]
    assert_engine_empty(engine)


def test_abort_mid_generation_frees_everything(tiny_qwen3_dir: Path) -> None:
    engine = make_engine(tiny_qwen3_dir)
    params = SamplingParams(max_tokens=50, n=2, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), params)
    engine.add_request("b", list(range(5, 30)), SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.can_admit(10)
    deltas = engine.abort_request("a")
    assert sorted(d.index for d in deltas) == [0, 1]
    assert all(d.finish_reason == FinishReason.CANCELLED for d in deltas)
    while engine.has_unfinished_requests():
        engine.step()
    assert_engine_empty(engine)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_llm_generate(tiny_qwen3_dir: Path) -> None:
    from workers import LLM

    llm = LLM(str(tiny_qwen3_dir), dtype="float32", kv_cache_bytes=64 * BYTES_PER_BLOCK)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["The quick brown fox", [7, 8, 9, 10]], params)
    assert [o.request_id for o in outs] == ["0", "1"]
    assert outs[0].prompt == "The quick brown fox" and outs[1].prompt is None
    assert outs[1].prompt_token_ids == [7, 8, 9, 10]
    assert all(len(o.token_ids) == 5 and o.finish_reason == FinishReason.LENGTH for o in outs)
    whole = llm.tokenizer.decode(
        outs[0].token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    # a character cut by max_tokens is dropped, not emitted as U+FFFD
    assert outs[0].text == whole.rstrip("\ufffd") and outs[0].text
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_qwen3_dir), tensor_parallel_size=0)


def test_max_model_len_never_exceeds_what_the_kv_cache_holds(tiny_qwen3_dir: Path,
                                                             caplog) -> None:
    """A context one sequence cannot fit in the KV cache is clamped (with a warning), so
    such a request is refused at add_request instead of failing later in a step; an
    explicit max_model_len beyond the cache is a start-up error naming the fix."""
    full = make_engine(tiny_qwen3_dir).max_model_len  # the checkpoint's context length
    engine = make_engine(tiny_qwen3_dir, num_blocks=4)  # 4 blocks x 16 tokens
    assert engine.max_model_len == 64 < full
    assert "serving max_model_len 64" in caplog.text
    with pytest.raises(PromptTooLongError):
        engine.add_request("long", list(range(10, 60)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="lower max_model_len or give the KV cache more"):
        make_engine(tiny_qwen3_dir, num_blocks=4, max_model_len=128)


def _run_with_priorities(engine: Engine, requests: list[tuple[str, list[int], SamplingParams,
                                                             int, int]]) -> dict[str, list[int]]:
    """Step until done, adding (request_id, prompt, params, priority, arrival step)."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or any(r[4] >= step for r in requests):
        for request_id, prompt, params, priority, at in requests:
            if at == step:
                engine.add_request(request_id, prompt, params, priority)
                tokens[request_id] = []
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
        step += 1
    return tokens


def test_a_background_band_that_gives_way_to_prompts_changes_no_tokens(
        tiny_qwen3_dir: Path) -> None:
    rng = random.Random(99)
    requests = []  # (request_id, prompt, params, priority, arrival step)
    for i in range(40):
        background = i % 4 != 0
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(4, 48))]
        params = SamplingParams(max_tokens=rng.randint(4, 16), temperature=0.0)
        requests.append((f"req{i}", prompt, params, 100 if background else rng.randint(0, 2),
                         rng.randint(0, 40)))
    engine = make_engine(tiny_qwen3_dir, max_num_seqs=16, max_num_batched_tokens=64,
                         long_prefill_token_threshold=24, background_priority=100)
    tokens = _run_with_priorities(engine, requests)
    assert engine.scheduler.bands.num_deferred_steps > 0
    assert_engine_empty(engine)
    alone = make_engine(tiny_qwen3_dir, enable_prefix_caching=False)
    for request_id, prompt, params, _, _ in requests:
        ref, _, _ = run_all(alone, {0: [(request_id, prompt, params)]})
        assert tokens[request_id] == ref[request_id][0], request_id


def test_background_steps_stopped_between_layers_change_no_tokens(tiny_qwen3_dir: Path) -> None:
    """A background-only step that stops between layers (`Engine.set_step_yield`, how the
    service lets an interactive job in) runs again in full: no token changes, and the KV
    it half wrote is never served from the prefix cache."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(40)]  # 2.5 blocks several prompts share
    requests = []
    for i in range(24):
        head = shared if i % 3 == 0 else []
        prompt = head + [rng.randrange(3, 500) for _ in range(rng.randint(4, 40))]
        params = SamplingParams(max_tokens=rng.randint(8, 24), temperature=0.0)
        requests.append((f"req{i}", prompt, params, 100 if i % 5 else 0, rng.randint(0, 30)))
    engine = make_engine(tiny_qwen3_dir, max_num_seqs=8, max_num_batched_tokens=64,
                         long_prefill_token_threshold=24, background_priority=100)
    asks: list[int] = []

    def should_yield() -> bool:
        asks.append(1)
        return len(asks) % 3 != 0  # stops before layer 0, or before layer 1 after layer 0

    # the tiny model has 2 layers: both (the default, said here as the test's premise)
    assert engine.set_step_yield(should_yield, before_layers=2)
    tokens = _run_with_priorities(engine, requests)
    # a second wave of the same prompts reads the prefix cache the first one filled
    again = [(f"again{i}", prompt, params, priority, 0)
             for i, (_, prompt, params, priority, _) in enumerate(requests)]
    tokens_again = _run_with_priorities(engine, again)
    stopped = engine.num_interrupted_steps
    assert stopped >= 10 and engine.stats().num_interrupted_steps == stopped
    assert len(asks) > stopped  # some steps were asked at layer 1, after layer 0 ran
    assert engine.stats().prefix_cache_hits > 0
    assert_engine_empty(engine)
    alone = make_engine(tiny_qwen3_dir, enable_prefix_caching=False)
    for i, (request_id, prompt, params, _, _) in enumerate(requests):
        ref, _, _ = run_all(alone, {0: [(request_id, prompt, params)]})
        assert tokens[request_id] == ref[request_id][0], request_id
        assert tokens_again[f"again{i}"] == ref[request_id][0], request_id


def test_a_background_step_may_stop_before_its_last_layer_by_default(
        tiny_qwen3_dir: Path) -> None:
    """The default lets a step stop before any layer: a foreground job that arrives late
    in a step waits for one layer, not for the rest of the step."""
    engine = make_engine(tiny_qwen3_dir, background_priority=100)
    asks_this_step = [0]

    def should_yield() -> bool:
        asks_this_step[0] += 1
        return asks_this_step[0] == 2  # before layer 1, the last of the tiny model's 2

    assert engine.set_step_yield(should_yield)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine.add_request("bg", [5, 6, 7, 8, 9], params, 100)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        asks_this_step[0] = 0
        tokens += [t for delta in engine.step() for t in delta.new_token_ids]
    assert engine.num_interrupted_steps >= 4  # every other step: never twice in a row
    ref, _, _ = run_all(make_engine(tiny_qwen3_dir), {0: [("bg", [5, 6, 7, 8, 9], params)]})
    assert tokens == ref["bg"][0]


def test_steps_with_foreground_work_never_stop(tiny_qwen3_dir: Path) -> None:
    engine = make_engine(tiny_qwen3_dir, background_priority=100)
    asks: list[int] = []
    assert engine.set_step_yield(lambda: bool(asks.append(1)) or True)
    tokens = _run_with_priorities(engine, [
        (f"fg{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0.0), 0, i)
        for i in range(4)])
    assert not asks and engine.num_interrupted_steps == 0
    assert all(len(t) == 6 for t in tokens.values())
    # background decodes beside a foreground prompt or decode: never asked; alone: asked
    mixed = make_engine(tiny_qwen3_dir, background_priority=100)
    asked_at: list[list[int]] = []

    def should_yield() -> bool:
        asked_at.append([s.priority for s in mixed.scheduler.running])
        return False

    assert mixed.set_step_yield(should_yield)
    mixed.add_request("bg", [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.0), 100)
    for _ in range(3):
        mixed.step()
    before = len(asked_at)
    assert before > 0
    mixed.add_request("fg", list(range(9, 60)), SamplingParams(max_tokens=4, temperature=0.0))
    mixed.step()  # the foreground prompt (alone: the band waits for it)
    assert len(asked_at) == before
    mixed.step()  # the foreground decode beside the background one
    assert len(asked_at) == before
    while mixed.has_unfinished_requests():
        mixed.step()
    assert len(asked_at) > before and all(p == [100] for p in asked_at)
    # without a step yield (the default) a background step is never asked either
    plain = make_engine(tiny_qwen3_dir, background_priority=100)
    plain.add_request("bg", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0), 100)
    while plain.has_unfinished_requests():
        plain.step()
    assert plain.num_interrupted_steps == 0


def test_a_native_decoder_step_stops_on_its_flag_and_changes_no_tokens(
        tiny_qwen3_dir: Path, monkeypatch) -> None:
    """With the native decoder taking the decode steps (one C call for every layer), a
    background-only step reads the engine's stop flag between layers without the GIL:
    set (here before the step, with `should_yield` still False, so only the C loop can
    see it), the step stops and runs again in full; no token changes."""
    from kernels import native

    if not native.available():
        pytest.skip("no C compiler here: the native decoder cannot be built")
    monkeypatch.setenv("LLMQ_LINEAR_PATH", "native")
    monkeypatch.setenv("LLMQ_CPU_KERNELS", "native")
    engine = make_engine(tiny_qwen3_dir, background_priority=100)
    assert engine.runner.decoder_rows > 0
    assert engine.set_step_yield(lambda: False)
    flag = engine.step_stop_flag
    assert flag is not None and not flag.is_set()
    params = SamplingParams(max_tokens=10, temperature=0.0)
    engine.add_request("bg", [5, 6, 7, 8, 9], params, 100)
    tokens: list[int] = []
    steps = 0
    while engine.has_unfinished_requests():
        if steps % 2:
            flag.set()
        tokens += [t for delta in engine.step() for t in delta.new_token_ids]
        flag.clear()
        steps += 1
    # every set flag after the prompt stopped a decoder step (never two steps in a row)
    assert engine.num_interrupted_steps >= 3
    ref, _, _ = run_all(make_engine(tiny_qwen3_dir), {0: [("bg", [5, 6, 7, 8, 9], params)]})
    assert tokens == ref["bg"][0]
    # a foreground step never reads the flag
    engine.add_request("fg", [5, 6, 7, 8, 9], params)
    stopped = engine.num_interrupted_steps
    flag.set()
    fg: list[int] = []
    while engine.has_unfinished_requests():
        fg += [t for delta in engine.step() for t in delta.new_token_ids]
    flag.clear()
    assert engine.num_interrupted_steps == stopped and fg == ref["bg"][0]
