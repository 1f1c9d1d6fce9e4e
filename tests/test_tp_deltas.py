"""Step inputs to the TP ranks as deltas (workers/engine/parallel/step_delta.py): a fresh
rank cache decoding rank 0's deltas rebuilds every step exactly — through chunked
prefill, samples sharing a prompt, preemption and resume, finished and aborted
sequences — and a rank whose cache would disagree refuses the step."""

from __future__ import annotations

import copy
import itertools
import random
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler

import pytest

from kvcache.kv_cache_manager import KVCacheManager
from tasks.params import SamplingParams
from workers.engine.parallel.messages import RunStep
from workers.engine.parallel.step_delta import (
    CachedSequence,
    NewSequence,
    StepDecoder,
    StepDelta,
    StepDeltaError,
    StepEncoder,
)
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_io import ModelRunnerOutput, ScheduledSequence, SchedulerOutput


def _over_the_pipe(delta: StepDelta) -> StepDelta:
    """What a rank receives: the delta pickled and unpickled as `Connection.send` does."""
    return ForkingPickler.loads(ForkingPickler.dumps(delta))


def _as_rank_sees_it(out: SchedulerOutput) -> SchedulerOutput:
    """The step a rank runs: the same, without the token histories (ranks never sample)."""
    return replace(out, scheduled=[replace(s, prompt_token_ids=[], output_token_ids=[])
                                   for s in out.scheduled])


def _sample(out: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
    ids = [s.seq_id for s in out.scheduled if s.sample]
    return ModelRunnerOutput(ids, [rng.randrange(3, 500) for _ in ids], [None] * len(ids))


def test_decoding_the_deltas_of_a_scheduler_run_rebuilds_every_step_exactly() -> None:
    # few blocks (preemption), a small token budget (chunked prefill, running sequences
    # left out of a step), prefix caching and n=2 (samples sharing prompt blocks)
    sched = Scheduler(KVCacheManager(24, 4, True), max_num_seqs=6, max_num_batched_tokens=20,
                      max_model_len=128, eos_token_ids=[2])
    rng = random.Random(7)
    ids = itertools.count()
    encoder, decoder = StepEncoder(), StepDecoder()
    expected: list[SchedulerOutput] = []
    decoded: list[SchedulerOutput] = []
    kinds = {"new": 0, "cached": 0, "appended_blocks": 0, "dropped": 0, "resumed": 0}
    preempted: set[int] = set()
    aborted = False
    for step in range(400):
        if step < 40 and step % 4 == 0:  # requests keep arriving while others decode
            prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 30))]
            params = SamplingParams(max_tokens=rng.randrange(4, 24), ignore_eos=True,
                                    n=2 if step % 8 == 0 else 1)
            arrival = next(ids)
            sched.add_seqs([Sequence(next(ids), f"r{arrival}", i, list(prompt), params, 0,
                                     arrival) for i in range(params.n)])
        if step == 20 and sched.running:  # a cancel mid-run
            sched.finish_seqs([sched.running[0]], SequenceStatus.FINISHED_ABORTED)
            aborted = True
        out = sched.schedule()
        delta = encoder.encode(out)
        got = decoder.decode(_over_the_pipe(delta), out.blocks_to_load)
        want = copy.deepcopy(_as_rank_sees_it(out))
        assert got == want, f"step {step}"
        expected.append(want)
        decoded.append(got)
        for entry in delta.scheduled:
            if isinstance(entry, NewSequence):
                kinds["new"] += 1
                kinds["resumed"] += entry.seq_id in preempted
            else:
                kinds["cached"] += 1
                kinds["appended_blocks"] += bool(entry.new_block_ids)
        kinds["dropped"] += len(delta.dropped_seq_ids)
        preempted.update(out.preempted_seq_ids)
        sched.update_from_output(out, _sample(out, rng))
        if not sched.has_unfinished_seqs() and step >= 40:
            break
    assert not sched.has_unfinished_seqs() and aborted
    assert preempted and sched.num_preemptions > 0
    assert all(kinds.values()), kinds
    # the rank's tables are new lists when they grow: earlier steps are left as they were
    assert decoded == expected
    # the last sequences finished after the last step: the next (empty) step drops them
    last = encoder.encode(sched.schedule())
    assert last.scheduled == [] and last.dropped_seq_ids
    decoder.decode(_over_the_pipe(last), [])
    assert decoder.num_held == encoder.num_held == 0


def _seq(seq_id: int, token_ids: list[int], start_pos: int, block_table: list[int],
         params: SamplingParams) -> ScheduledSequence:
    return ScheduledSequence(seq_id, token_ids, start_pos, block_table, True, params,
                             [9, 9], [9])


def _roundtrip(encoder: StepEncoder, decoder: StepDecoder,
               *seqs: ScheduledSequence) -> StepDelta:
    out = SchedulerOutput(list(seqs), sum(len(s.token_ids) for s in seqs))
    delta = encoder.encode(out)
    assert decoder.decode(_over_the_pipe(delta), []) == _as_rank_sees_it(out)
    return delta


def test_only_appending_is_sent_as_a_delta_anything_else_whole() -> None:
    params = SamplingParams(max_tokens=8)
    encoder, decoder = StepEncoder(), StepDecoder()
    first = _roundtrip(encoder, decoder, _seq(1, [5, 6, 7, 8, 9], 0, [3, 4], params))
    assert isinstance(first.scheduled[0], NewSequence)
    # next position, one more block: a delta of one token and one block
    delta = _roundtrip(encoder, decoder, _seq(1, [10, 11, 12, 13], 5, [3, 4, 8], params))
    assert delta.scheduled == [CachedSequence(1, [10, 11, 12, 13], [8], True)]
    delta = _roundtrip(encoder, decoder, _seq(1, [14], 9, [3, 4, 8], params))
    assert delta.scheduled == [CachedSequence(1, [14], [], True)]
    # a block replaced in place, a position that jumps, new params: sent whole
    for changed in (_seq(1, [15], 10, [3, 6, 8], params),
                    _seq(1, [16], 12, [3, 6, 8], params),
                    _seq(1, [17], 13, [3, 6, 8], SamplingParams(max_tokens=8))):
        (entry,) = _roundtrip(encoder, decoder, changed).scheduled
        assert isinstance(entry, NewSequence) and entry.block_table == changed.block_table
    # a sequence left out of a step is dropped, and sent whole when it comes back
    delta = _roundtrip(encoder, decoder, _seq(2, [1, 2], 0, [0], params))
    assert delta.dropped_seq_ids == [1] and decoder.num_held == 1
    delta = _roundtrip(encoder, decoder, _seq(2, [3], 2, [0], params),
                       _seq(1, [18], 14, [3, 6, 8, 9], params))
    assert [type(e) for e in delta.scheduled] == [CachedSequence, NewSequence]


def test_reset_sends_every_sequence_whole_and_clears_a_stale_rank() -> None:
    params = SamplingParams(max_tokens=8)
    encoder, decoder = StepEncoder(), StepDecoder()
    _roundtrip(encoder, decoder, _seq(1, [5, 6], 0, [0], params), _seq(2, [7], 0, [1], params))
    # a step the rank never received, then the driver resets after the failed step
    encoder.encode(SchedulerOutput([_seq(1, [8], 2, [0], params)], 1))
    encoder.reset()
    delta = _roundtrip(encoder, decoder, _seq(1, [8], 2, [0], params),
                       _seq(3, [4, 4], 0, [2], params))
    assert delta.reset and not delta.dropped_seq_ids
    assert all(isinstance(e, NewSequence) for e in delta.scheduled)
    assert decoder.num_held == 2  # sequence 2 went with the reset
    delta = _roundtrip(encoder, decoder, _seq(1, [9], 3, [0], params))
    assert not delta.reset and isinstance(delta.scheduled[0], CachedSequence)


def test_a_rank_refuses_a_delta_that_does_not_apply_to_what_it_holds() -> None:
    params = SamplingParams(max_tokens=8)
    encoder, decoder = StepEncoder(), StepDecoder()
    _roundtrip(encoder, decoder, _seq(1, [5, 6], 0, [0], params))
    lost = encoder.encode(SchedulerOutput([_seq(1, [7], 2, [0], params)], 1))
    with pytest.raises(StepDeltaError, match="step 2 arrived, expected step 1"):
        decoder.decode(encoder.encode(SchedulerOutput([_seq(1, [8], 3, [0], params)], 1)),
                       [])
    fresh = StepDecoder()
    with pytest.raises(StepDeltaError, match="continues sequence 1, which this rank does"):
        fresh.decode(replace(lost, step_index=0), [])
    with pytest.raises(StepDeltaError, match="drops sequence 4"):
        StepDecoder().decode(StepDelta(0, False, [4], [], 0, []), [])
    with pytest.raises(ValueError, match="scheduled twice"):
        StepEncoder().encode(SchedulerOutput([_seq(1, [1], 0, [0], params)] * 2, 2))


def _decode_heavy_step_bytes(prompt_len: int, num_seqs: int = 32) -> tuple[int, int]:
    """Pickled bytes of the 10th decode step of `num_seqs` sequences of `prompt_len`
    tokens: the whole step (as sent before deltas), and the `RunStep` sent now."""
    sched = Scheduler(KVCacheManager(num_seqs * (prompt_len // 16 + 2), 16), max_num_seqs=64,
                      max_num_batched_tokens=max(8192, prompt_len),
                      max_model_len=prompt_len + 64, eos_token_ids=[2])
    rng = random.Random(0)
    for i in range(num_seqs):
        sched.add_seqs([Sequence(i, f"r{i}", 0, [rng.randrange(3, 30000)
                                                 for _ in range(prompt_len)],
                                 SamplingParams(max_tokens=32, ignore_eos=True), 0, i)])
    encoder = StepEncoder()
    num_decodes = 0
    while num_decodes < 10:
        out = sched.schedule()
        message = RunStep(encoder.encode(out), [])
        sched.update_from_output(out, _sample(out, rng))
        num_decodes += out.num_batched_tokens == num_seqs  # decodes only
    return len(ForkingPickler.dumps(_as_rank_sees_it(out))), len(ForkingPickler.dumps(message))


def test_a_decode_step_delta_is_small_and_does_not_grow_with_the_context() -> None:
    whole_512, delta_512 = _decode_heavy_step_bytes(512)
    whole_4k, delta_4k = _decode_heavy_step_bytes(4096)
    assert delta_512 * 4 < whole_512
    assert whole_4k > 3 * whole_512  # the whole step carries every block table
    assert delta_4k < delta_512 * 1.1  # the delta carries one token per sequence
