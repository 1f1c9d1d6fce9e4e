"""Tensor parallelism on CPU (gloo): a group of 2 ranks (rank 0 here, rank 1 a spawned
process) gives the same greedy tokens as one device, and a lost rank fails the group
promptly instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tasks.params import SamplingParams

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "a long long time ago in a galaxy",
           "hello"]
NUM_NEW_TOKENS = 40


def _greedy(model_dir, tp: int) -> list[list[int]]:
    from workers.engine.llm import LLM

    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # a small chunk budget: the longer prompts are split over steps and run alongside
    # the others' decodes, so the mixed steps go through every collective too
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=tp, max_num_seqs=8,
             max_num_batched_tokens=12, kv_cache_bytes=8 << 20) as llm:
        if tp > 1:
            runner = llm.engine.runner
            assert runner.tp_size == tp and len(set(runner.rank_pids)) == tp
        return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_llama_dir"])
def test_tp2_greedy_tokens_equal_tp1(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    expected = _greedy(model_dir, 1)
    assert all(len(ids) == NUM_NEW_TOKENS for ids in expected)
    assert _greedy(model_dir, 2) == expected


def _greedy_preempting(model_dir, tp: int) -> tuple[list[list[int]], int]:
    """Greedy tokens of PROMPTS with 10 KV blocks (the tiny preset's block is 8 KiB at
    TP 1, a 4 KiB slab per rank at TP 2): the sequences outgrow them, so some are
    preempted and later resumed, which the ranks' step deltas resend whole."""
    from workers.engine.llm import LLM

    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=tp, max_num_seqs=8,
             max_num_batched_tokens=12, kv_cache_bytes=10 * (8 << 10) // tp) as llm:
        assert llm.engine.runner.num_blocks == 10
        tokens = [out.token_ids for out in llm.generate(PROMPTS, params)]
        return tokens, llm.engine.scheduler.num_preemptions


def test_tp2_greedy_tokens_equal_tp1_through_preemption(tiny_qwen3_dir):
    expected, num_preemptions = _greedy_preempting(tiny_qwen3_dir, 1)
    assert num_preemptions > 0
    assert _greedy_preempting(tiny_qwen3_dir, 2) == (expected, num_preemptions)


@pytest.fixture
def tp_runner(tiny_qwen3_dir):
    from workers.engine.parallel import make_tp_runner

    runner = make_tp_runner(str(tiny_qwen3_dir), device="cpu", tp_size=2, dtype="float32",
                            kv_cache_bytes=1 << 20, timeout_seconds=30.0)
    try:
        yield runner
    finally:
        runner.shutdown()


def _step(token_ids: list[int], block_table: list[int], start_pos: int = 0):
    from workers.engine.step_io import ScheduledSequence, SchedulerOutput

    params = SamplingParams(max_tokens=4, temperature=0.0)
    seq = ScheduledSequence(0, token_ids, start_pos, block_table, True, params,
                            list(token_ids), [])
    return SchedulerOutput([seq], len(token_ids))


def test_kv_blocks_gather_and_scatter_over_ranks(tp_runner):
    """A group blob is every rank's slab; writing it elsewhere and decoding from there
    gives the same token as from the original blocks."""
    prompt = list(range(10, 30))  # 20 tokens: block 0 full, block 1 partly
    first = tp_runner.execute(_step(prompt, [0, 1])).sampled_token_ids
    blobs = tp_runner.read_blocks([0, 1])
    assert [len(b) for b in blobs] == [tp_runner.bytes_per_block] * 2
    assert tp_runner.bytes_per_block == 2 * tp_runner._local.bytes_per_block
    tp_runner.write_blocks([(5, blobs[0]), (6, blobs[1])])
    assert tp_runner.read_blocks([5, 6]) == blobs
    from_copy = tp_runner.execute(_step(first, [5, 6], start_pos=20)).sampled_token_ids
    from_orig = tp_runner.execute(_step(first, [0, 1], start_pos=20)).sampled_token_ids
    assert from_copy == from_orig
    with pytest.raises(ValueError, match="TP layout"):
        tp_runner.write_blocks([(3, blobs[0][:100])])


@pytest.mark.alone
def test_a_dead_rank_fails_the_step_and_every_later_one(tp_runner):
    from workers.engine.parallel import TensorParallelError

    failures: list[str] = []

    def slow_callback(reason: str) -> None:
        time.sleep(0.5)  # a step must not raise before the callbacks have run
        failures.append(reason)

    tp_runner.on_failure(slow_callback)
    tp_runner.execute(_step([1, 2, 3], [0]))
    rank1 = tp_runner.rank_pids[1]
    os.kill(rank1, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {rank1}\\) died"):
        # the watchdog may fail the group before the step, or the step's collective fails
        tp_runner.execute(_step([4, 5, 6], [1]))
    assert time.monotonic() - started < 10.0
    assert failures and "died" in failures[0] and len(failures) == 1
    with pytest.raises(TensorParallelError, match="died"):
        tp_runner.execute(_step([7], [2]))


def test_kv_tier_blocks_written_by_one_tp_group_are_hits_for_another(tiny_qwen3_dir,
                                                                     tmp_path):
    """A TP group's tier blob holds every rank's slab: a second group loads the prefix
    from the tier and generates the same tokens."""
    from workers.engine.llm import LLM

    tier = f"file://{tmp_path}/kv?max_bytes=100000000"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 70))  # 65 tokens: 4 full blocks
    with LLM(str(tiny_qwen3_dir), dtype="float32", tensor_parallel_size=2,
             kv_tiers=[tier], kv_cache_bytes=1 << 20) as first:
        expected = first.generate([prompt], params)[0].token_ids
    with LLM(str(tiny_qwen3_dir), dtype="float32", tensor_parallel_size=2,
             kv_tiers=[tier], kv_cache_bytes=1 << 20) as second:
        out = second.generate([prompt], params)[0]
        figures = second.engine.kv_connector.figures()
    assert out.token_ids == expected
    assert out.num_cached_tokens == 64
    assert sum(f["hit_blocks"] for f in figures.values()) == 4


def test_one_tp_group_per_process(tp_runner, tiny_qwen3_dir):
    from workers.engine.parallel import TensorParallelError, make_tp_runner

    with pytest.raises(TensorParallelError, match="close\\(\\) the other engine or LLM"):
        make_tp_runner(str(tiny_qwen3_dir), device="cpu", tp_size=2, dtype="float32")


def test_a_rank_refuses_a_step_delta_it_cannot_apply(tp_runner):
    """A rank whose cache of sequences would disagree with rank 0's fails with the reason
    instead of running a forward over a guessed block table; the group stops."""
    from workers.engine.parallel import TensorParallelError
    from workers.engine.parallel.launch import recv
    from workers.engine.parallel.messages import BlocksRead, RunStep
    from workers.engine.parallel.step_delta import CachedSequence, StepDelta

    tp_runner.execute(_step([1, 2, 3], [0]))
    conn = tp_runner._conns[0]
    # step 1 continues a sequence rank 1 never saw
    conn.send(RunStep(StepDelta(1, False, [0], [CachedSequence(7, [4], [], True)], 1, []), []))
    with pytest.raises(TensorParallelError, match="StepDeltaError: step 1 continues "
                                                  "sequence 7, which this rank does not hold"):
        recv(conn, BlocksRead, 30.0)
    with pytest.raises(TensorParallelError, match="rank 1 .* died"):
        tp_runner.execute(_step([4], [0], start_pos=3))
