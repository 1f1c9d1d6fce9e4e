"""Scheduler policy on CPU with a fake runner: exact token counts and block ids."""

from __future__ import annotations

import itertools

import pytest

from kvcache.kv_cache_manager import KVCacheManager
from tasks.params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_io import ModelRunnerOutput, SchedulerOutput

EOS = 2


class FakeRunner:
    """Samples `token` (or `tokens[seq_id]` in turn) for every sequence that samples."""

    def __init__(self, token: int = 7, tokens: dict[int, list[int]] | None = None) -> None:
        self.token = token
        self.tokens = {k: list(v) for k, v in (tokens or {}).items()}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        seq_ids = [s.seq_id for s in out.scheduled if s.sample]
        sampled = [self.tokens[i].pop(0) if self.tokens.get(i) else self.token for i in seq_ids]
        return ModelRunnerOutput(seq_ids, sampled, [None] * len(seq_ids))


_ids = itertools.count()


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = True,
    background_priority: int | None = None,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size, enable_prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_prefix_caching=enable_prefix_caching,
        background_priority=background_priority,
    )


def add(
    sched: Scheduler,
    prompt: list[int] | int,
    priority: int = 0,
    **params: object,
) -> list[Sequence]:
    if isinstance(prompt, int):
        prompt = [100 + next(_ids) % 1000 for _ in range(prompt)]
    sampling = SamplingParams(**{"max_tokens": 16, **params})  # type: ignore[arg-type]
    arrival = next(_ids)
    seqs = [
        Sequence(
            seq_id=next(_ids),
            request_id=f"r{arrival}",
            index=i,
            prompt_token_ids=list(prompt),
            params=sampling,
            priority=priority,
            arrival=arrival,
        )
        for i in range(sampling.n)
    ]
    sched.add_seqs(seqs)
    return seqs


def step(sched: Scheduler, runner: FakeRunner | None = None) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    sampled = sched.update_from_output(out, (runner or FakeRunner()).execute(out))
    return out, sampled


def chunks(out: SchedulerOutput) -> dict[int, int]:
    return {s.seq_id: len(s.token_ids) for s in out.scheduled}


def test_token_budget_exact_counts_per_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b, c = (add(sched, 8)[0] for _ in range(3))
    out, sampled = step(sched)
    assert chunks(out) == {a.seq_id: 8, b.seq_id: 2}
    assert out.num_batched_tokens == 10
    assert [s.seq_id for s in sampled] == [a.seq_id]
    out, sampled = step(sched)
    # a decodes one token, b finishes its prompt, c gets the rest of the budget
    assert chunks(out) == {a.seq_id: 1, b.seq_id: 6, c.seq_id: 3}
    assert [s.sample for s in out.scheduled] == [True, True, False]
    assert out.scheduled[2].start_pos == 0 and out.scheduled[1].start_pos == 2
    assert [s.seq_id for s in sampled] == [a.seq_id, b.seq_id]
    out, _ = step(sched)
    assert chunks(out) == {a.seq_id: 1, b.seq_id: 1, c.seq_id: 5}
    assert a.num_computed_tokens == 10 and a.num_tokens == 11


def test_chunked_prefill_threshold_splits_long_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=6)
    (seq,) = add(sched, 15)
    starts = []
    for _ in range(3):
        out, _ = step(sched)
        (s,) = out.scheduled
        starts.append((s.start_pos, len(s.token_ids), s.sample))
    assert starts == [(0, 6, False), (6, 6, False), (12, 3, True)]
    assert seq.output_token_ids == [7]
    assert seq.token_ids[:15] == seq.prompt_token_ids


def test_exact_block_ids_and_prefix_hit() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks + 2
    (a,) = add(sched, prompt)
    add(sched, 5)
    out, _ = step(sched)
    assert [s.block_table for s in out.scheduled] == [[0, 1, 2], [3, 4]]
    # a's 11th token fits its third block; b's 6th token too
    out, _ = step(sched)
    assert [s.block_table for s in out.scheduled] == [[0, 1, 2], [3, 4]]
    out, _ = step(sched)  # a reaches 12 tokens computed -> still 3 blocks; b needs none
    for _ in range(2):
        out, _ = step(sched)
    assert sched.kv_manager.get_block_ids(a.seq_id) == [0, 1, 2, 5]
    # a new prompt sharing a's first 8 tokens hits a's two full blocks
    (c,) = add(sched, prompt[:8] + [99, 98, 97])
    out, _ = step(sched)
    sc = next(s for s in out.scheduled if s.seq_id == c.seq_id)
    assert sc.block_table[:2] == [0, 1]
    assert sc.start_pos == 8 and len(sc.token_ids) == 3 and sc.sample
    assert c.num_cached_tokens == 8
    assert sched.kv_manager.block_pool.blocks[0].ref_cnt == 2


def test_full_prefix_hit_still_computes_last_token() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(30, 38))  # exactly 2 full blocks
    (a,) = add(sched, prompt, max_tokens=1)
    step(sched)
    assert a.status == SequenceStatus.FINISHED_LENGTH
    (b,) = add(sched, prompt, max_tokens=1)
    out, sampled = step(sched)
    (sb,) = out.scheduled
    # only the first block may be taken: the last prompt token must be computed
    assert b.num_cached_tokens == 4
    assert sb.start_pos == 4 and sb.token_ids == prompt[4:] and sb.sample
    assert sampled == [b]


def test_preemption_order_and_requeue_at_front() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b, c, d = (add(sched, 4)[0] for _ in range(4))
    step(sched)  # four prompts fill the four blocks; each sampled one token
    assert sched.kv_manager.num_free_blocks == 0
    (e,) = add(sched, 3)
    out, _ = step(sched)
    # a needs a fifth block: d (latest) goes; b needs one: c goes
    assert out.preempted_seq_ids == [d.seq_id, c.seq_id]
    assert chunks(out) == {a.seq_id: 1, b.seq_id: 1}
    assert sched.waiting == [c, d, e]  # preempted first, in arrival order, then fresh
    assert c.status == d.status == SequenceStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.output_token_ids == [7]
    assert sched.num_preemptions == 2
    # once a and b finish, c recomputes its prompt and its output token together
    sched.finish_seqs([a, b], SequenceStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    assert chunks(out) == {c.seq_id: 5, d.seq_id: 5}
    assert out.scheduled[0].sample and c.num_output_tokens == 2


def test_preempts_lowest_priority_first() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4, enable_prefix_caching=False)
    (low,) = add(sched, 4, priority=1)
    (high1,) = add(sched, 4, priority=0)
    (high2,) = add(sched, 4, priority=0)
    out, _ = step(sched)
    # the higher-priority (lower value) requests are admitted first
    assert [s.seq_id for s in out.scheduled] == [high1.seq_id, high2.seq_id, low.seq_id]
    out, _ = step(sched)
    # high1 takes low's block; high2 then finds nothing left but itself to preempt
    assert out.preempted_seq_ids == [low.seq_id, high2.seq_id]
    assert chunks(out) == {high1.seq_id: 1}
    assert sched.waiting == [high2, low]  # waiting is ordered by priority first


def test_max_num_seqs_respected() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=1000)
    seqs = [add(sched, 5)[0] for _ in range(5)]
    out, _ = step(sched)
    assert len(out.scheduled) == 3 and sched.num_running == 3 and sched.num_waiting == 2
    sched.finish_seqs([seqs[0]], SequenceStatus.FINISHED_ABORTED)
    out, _ = step(sched)
    assert len(out.scheduled) == 3 and seqs[3] in sched.running


def test_finish_on_max_tokens() -> None:
    sched = make_scheduler()
    (seq,) = add(sched, 4, max_tokens=3)
    for _ in range(3):
        step(sched)
    assert seq.status == SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == [7, 7, 7]
    assert not sched.has_unfinished_seqs()


def test_finish_on_max_model_len() -> None:
    sched = make_scheduler(max_model_len=8)
    (seq,) = add(sched, 6, max_tokens=2)
    step(sched)
    step(sched)
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 8


def test_finish_on_stop_token_id() -> None:
    sched = make_scheduler()
    (seq,) = add(sched, 4, stop_token_ids=[42])
    runner = FakeRunner(tokens={seq.seq_id: [5, 42, 6]})
    step(sched, runner)
    step(sched, runner)
    assert seq.status == SequenceStatus.FINISHED_STOPPED
    assert seq.stop_reason == 42 and seq.output_token_ids == [5, 42]


def test_eos_not_honoured_before_min_tokens() -> None:
    sched = make_scheduler()
    (seq,) = add(sched, 4, min_tokens=2)
    (free,) = add(sched, 4, ignore_eos=True, max_tokens=3)
    runner = FakeRunner(tokens={seq.seq_id: [EOS, EOS, 9], free.seq_id: [EOS, EOS, EOS]})
    step(sched, runner)
    assert seq.status == SequenceStatus.RUNNING  # 1 token < min_tokens
    step(sched, runner)
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.output_token_ids == [EOS, EOS]
    step(sched, runner)
    assert free.status == SequenceStatus.FINISHED_LENGTH
    assert free.output_token_ids == [EOS, EOS, EOS]


def test_abort_frees_everything() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    seqs = [add(sched, 6)[0] for _ in range(3)]
    step(sched)  # seq 0 computed, seq 1 not started
    step(sched)
    sched.finish_seqs(seqs, SequenceStatus.FINISHED_ABORTED)
    kv = sched.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not sched.running and not sched.waiting and not sched.seqs and not sched.deferred
    assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in seqs)
    out, _ = step(sched)
    assert out.scheduled == []


def test_n_samples_share_prompt_blocks() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4)
    s0, s1, s2 = add(sched, list(range(50, 60)), n=3)  # 10 tokens: 2 full blocks
    out, _ = step(sched)
    assert chunks(out) == {s0.seq_id: 10}  # the other samples wait for the prompt's blocks
    out, _ = step(sched)
    assert chunks(out) == {s0.seq_id: 1, s1.seq_id: 2, s2.seq_id: 2}
    t0, t1, t2 = (sched.kv_manager.get_block_ids(s.seq_id) for s in (s0, s1, s2))
    assert t0[:2] == t1[:2] == t2[:2]
    assert s1.num_cached_tokens == s2.num_cached_tokens == 8
    assert sched.kv_manager.block_pool.blocks[t0[0]].ref_cnt == 3


def test_duplicate_seq_rejected() -> None:
    sched = make_scheduler()
    seqs = add(sched, 4)
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_seqs(seqs)
