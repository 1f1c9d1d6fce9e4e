"""A model step that raises harms only the request that makes it raise: the engine runs
the step's sequences alone to find it, fails it with the reason, and the others produce
exactly what they produce alone; KV the failed step was to write is never reused."""

from __future__ import annotations

import random
from pathlib import Path

from tasks.params import SamplingParams
from tests.test_engine import assert_engine_empty, make_engine, run_all
from workers.engine.core import Engine
from workers.engine.outputs import FinishReason
from workers.engine.step_io import SchedulerOutput

POISON = 7  # a prompt starting with this token makes every step that runs it raise
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class FaultyRunner:
    """The real runner, with faults injected into `execute`: a step raises when it runs a
    poisoned sequence past its prompt (a decode), or once when `fail_next` is set."""

    def __init__(self, engine: Engine) -> None:
        self.inner = engine.runner
        self.fail_next = False
        self.num_failures = 0
        self.batch_sizes: list[int] = []
        engine.runner = self

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, scheduler_output: SchedulerOutput):
        self.batch_sizes.append(len(scheduler_output.scheduled))
        poisoned = any(s.prompt_token_ids[0] == POISON and s.output_token_ids
                       for s in scheduler_output.scheduled)
        if poisoned or self.fail_next:
            self.fail_next = False
            self.num_failures += 1
            raise RuntimeError("device-side assert triggered")
        return self.inner.execute(scheduler_output)


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(rng.randrange(20, 60))]
            for _ in range(count)]


def _solo_tokens(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    result = []
    for prompt in prompts:
        tokens, _, _ = run_all(make_engine(model_dir), {0: [("solo", prompt, GREEDY)]})
        result.append(tokens["solo"][0])
    return result


def test_only_the_poisoned_request_fails_and_the_others_match_their_solo_runs(
    tiny_qwen3_dir: Path,
) -> None:
    innocents = _prompts(1, 4)
    culprit = [POISON] + _prompts(2, 1)[0]
    engine = make_engine(tiny_qwen3_dir)
    runner = FaultyRunner(engine)
    arrivals = {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(innocents[:2])]
                + [("culprit", culprit, GREEDY)],
                3: [(f"r{i}", p, GREEDY) for i, p in enumerate(innocents[2:], start=2)]}

    tokens, _, finals = run_all(engine, arrivals)

    final = finals["culprit"][0]
    assert final.finish_reason is FinishReason.ERROR
    assert "device-side assert triggered" in (final.error or "")
    assert len(tokens["culprit"][0]) == 1  # its first token (prefill) came out, then it failed
    solo = _solo_tokens(tiny_qwen3_dir, innocents)
    for i in range(4):
        assert finals[f"r{i}"][0].finish_reason is FinishReason.LENGTH
        assert tokens[f"r{i}"][0] == solo[i], f"innocent r{i} changed"
    # the search ran the culprit alone and failed it there: no innocent step failed alone
    assert runner.num_failures == 2 and 1 in runner.batch_sizes
    assert engine.num_failed_steps == 2 and engine.num_consecutive_failed_steps == 0
    assert not engine.scheduler.suspects
    assert_engine_empty(engine)


def test_a_transient_failure_fails_nobody_and_poisons_no_cache(tiny_qwen3_dir: Path) -> None:
    """The step raises once mid-prefill: every request still finishes with its solo text,
    and the same prompts afterwards (prefix-cache hits) give a fresh engine's output."""
    prompts = _prompts(3, 5)
    engine = make_engine(tiny_qwen3_dir, max_num_batched_tokens=64)  # chunked prefill
    runner = FaultyRunner(engine)
    run_all(engine, {0: [(f"warm{i}", p[:16], GREEDY) for i, p in enumerate(prompts)]})
    runner.fail_next = True  # the next step raises: its blocks were never written

    first, _, finals = run_all(engine, {0: [(f"a{i}", p, GREEDY) for i, p in enumerate(prompts)]})
    again, _, _ = run_all(engine, {0: [(f"b{i}", p, GREEDY) for i, p in enumerate(prompts)]})

    solo = _solo_tokens(tiny_qwen3_dir, prompts)
    assert runner.num_failures == 1
    for i in range(5):
        assert finals[f"a{i}"][0].finish_reason is FinishReason.LENGTH
        assert first[f"a{i}"][0] == solo[i]
        assert again[f"b{i}"][0] == solo[i]
    assert engine.scheduler.prefix_hits_tokens > 0  # the second round did hit the cache
    assert_engine_empty(engine)


def test_a_device_that_fails_every_step_counts_consecutive_failures(
    tiny_qwen3_dir: Path,
) -> None:
    """Nothing is innocent on a broken device: the search fails requests one by one and
    the consecutive-failure count (the service's circuit breaker) keeps growing."""
    engine = make_engine(tiny_qwen3_dir)
    runner = FaultyRunner(engine)
    for i, prompt in enumerate(_prompts(4, 3)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    failed = []
    for _ in range(4):
        runner.fail_next = True
        failed += [d.request_id for d in engine.step() if d.finish_reason is FinishReason.ERROR]
    assert engine.num_consecutive_failed_steps == 4
    assert len(failed) == 3 and len(set(failed)) == 3  # a batch step, then each alone
    assert_engine_empty(engine)


def test_blocks_of_a_failed_prefill_are_never_hit(tiny_qwen3_dir: Path) -> None:
    """A request that fails its prefill leaves its blocks unwritten: the same prompt
    afterwards must compute them, not hit them (the old abort path freed them hashed)."""
    (prompt,) = _prompts(5, 1)
    engine = make_engine(tiny_qwen3_dir)
    runner = FaultyRunner(engine)
    runner.fail_next = True
    _, _, finals = run_all(engine, {0: [("fails", prompt, GREEDY)]})
    assert finals["fails"][0].finish_reason is FinishReason.ERROR
    hits_before = engine.scheduler.prefix_hits_tokens

    tokens, _, _ = run_all(engine, {0: [("again", prompt, GREEDY)]})

    assert engine.scheduler.prefix_hits_tokens == hits_before  # nothing to hit
    assert tokens["again"][0] == _solo_tokens(tiny_qwen3_dir, [prompt])[0]
    assert_engine_empty(engine)
