"""Priority bands (workers/engine/priority_bands.py): a step that carries a foreground
prompt chunk leaves the background band out; exact chunks per step on a fake runner."""

from __future__ import annotations

from tests.test_scheduler import add, chunks, make_scheduler, step
from workers.engine.priority_bands import MAX_DEFERRED_IN_A_ROW, PriorityBands
from workers.engine.sequence import SequenceStatus

BACKGROUND = 100  # the band: priorities >= 100


def test_foreground_prefill_runs_without_the_background_band() -> None:
    sched = make_scheduler(background_priority=BACKGROUND)
    bg1, bg2 = (add(sched, 4, priority=BACKGROUND)[0] for _ in range(2))
    step(sched)  # both prompts, one token each
    tables = {s.seq_id: list(s.block_table) for s in (bg1, bg2)}
    (fg,) = add(sched, 6)
    out, sampled = step(sched)
    assert chunks(out) == {fg.seq_id: 6}
    assert sampled == [fg]
    # the band sat the step out: still running, KV kept, nothing computed, not preempted
    for seq in (bg1, bg2):
        assert seq.status == SequenceStatus.RUNNING
        assert seq.block_table == tables[seq.seq_id]
        assert seq.num_computed_tokens == 4 and seq.num_output_tokens == 1
    assert out.preempted_seq_ids == [] and sched.num_preemptions == 0
    # once the prompt is computed, the foreground sequence decodes beside the band
    out, _ = step(sched)
    assert chunks(out) == {fg.seq_id: 1, bg1.seq_id: 1, bg2.seq_id: 1}
    assert sched.bands.num_deferred_steps == 1


def test_every_chunk_of_a_long_prompt_leaves_the_band_out() -> None:
    sched = make_scheduler(background_priority=BACKGROUND, long_prefill_token_threshold=4)
    (bg,) = add(sched, 3, priority=BACKGROUND)
    step(sched)
    (fg,) = add(sched, 10)
    assert [chunks(step(sched)[0]) for _ in range(4)] == [
        {fg.seq_id: 4}, {fg.seq_id: 4}, {fg.seq_id: 2}, {fg.seq_id: 1, bg.seq_id: 1}]
    assert bg.num_output_tokens == 2 and fg.num_output_tokens == 2


def test_no_background_line_is_admitted_beside_a_foreground_prefill() -> None:
    sched = make_scheduler(background_priority=BACKGROUND)
    (bg1,) = add(sched, 4, priority=BACKGROUND)
    step(sched)
    (bg2,) = add(sched, 4, priority=BACKGROUND)
    (fg,) = add(sched, 5)
    out, _ = step(sched)
    assert chunks(out) == {fg.seq_id: 5}
    assert sched.waiting == [bg2]
    out, _ = step(sched)
    assert chunks(out) == {fg.seq_id: 1, bg1.seq_id: 1, bg2.seq_id: 4}


def test_foreground_decodes_do_not_hold_the_band_back() -> None:
    sched = make_scheduler(background_priority=BACKGROUND)
    (fg,) = add(sched, 4)
    (bg,) = add(sched, 4, priority=BACKGROUND)
    out, _ = step(sched)  # no band sequence runs yet: nothing to leave out
    assert chunks(out) == {fg.seq_id: 4, bg.seq_id: 4}
    out, _ = step(sched)
    assert chunks(out) == {fg.seq_id: 1, bg.seq_id: 1}
    assert sched.bands.num_deferred_steps == 0


def test_without_a_band_prefill_and_decodes_share_the_step() -> None:
    sched = make_scheduler()  # background_priority None
    (bg,) = add(sched, 4, priority=BACKGROUND)
    step(sched)
    (fg,) = add(sched, 6)
    out, _ = step(sched)
    assert chunks(out) == {fg.seq_id: 6, bg.seq_id: 1}


def test_a_prompt_that_cannot_be_admitted_does_not_stop_the_band() -> None:
    # 6 blocks of 4: the band holds 2 + 2, a 12-token prompt needs 3 more
    sched = make_scheduler(num_blocks=6, block_size=4, background_priority=BACKGROUND,
                           enable_prefix_caching=False)
    bg1, bg2 = (add(sched, 5, priority=BACKGROUND)[0] for _ in range(2))
    step(sched)
    (fg,) = add(sched, 12)
    out, _ = step(sched)
    assert chunks(out) == {bg1.seq_id: 1, bg2.seq_id: 1}
    assert sched.waiting == [fg]


def test_a_deferral_that_ran_no_prompt_is_not_repeated() -> None:
    sched = make_scheduler(background_priority=BACKGROUND)
    (bg,) = add(sched, 4, priority=BACKGROUND)
    step(sched)
    (fg,) = add(sched, 6)
    bands: PriorityBands = sched.bands
    assert bands.defers_background(sched.running, sched.waiting, lambda seq: True)
    bands.step_built(True, [], sched.seqs)  # e.g. its prefix lookup went off the step
    assert not bands.defers_background(sched.running, sched.waiting, lambda seq: True)
    assert bands.defers_background(sched.running, sched.waiting, lambda seq: True)
    assert not bands.defers_background(sched.running, sched.waiting, lambda seq: False)


def test_the_band_runs_at_least_once_every_few_steps_while_prompts_keep_coming() -> None:
    sched = make_scheduler(background_priority=BACKGROUND, long_prefill_token_threshold=2)
    (bg,) = add(sched, 3, priority=BACKGROUND)
    step(sched)
    (fg,) = add(sched, 4 * MAX_DEFERRED_IN_A_ROW)  # a prompt in 2-token chunks
    carried = [bg.seq_id in chunks(step(sched)[0]) for _ in range(2 * MAX_DEFERRED_IN_A_ROW)]
    assert carried == ([False] * MAX_DEFERRED_IN_A_ROW + [True]) + [False] * (
        MAX_DEFERRED_IN_A_ROW - 1)
    assert fg.num_computed_tokens == 2 * 2 * MAX_DEFERRED_IN_A_ROW


def test_a_foreground_prompt_takes_the_seat_of_the_last_background_sequence() -> None:
    sched = make_scheduler(max_num_seqs=2, block_size=4, background_priority=BACKGROUND)
    bg1, bg2 = (add(sched, 8, priority=BACKGROUND)[0] for _ in range(2))
    step(sched)  # both prompts: every seat is taken by the band
    (fg,) = add(sched, 5)
    out, sampled = step(sched)
    # the later band sequence gave its seat; the prompt ran without the band
    assert chunks(out) == {fg.seq_id: 5} and sampled == [fg]
    assert out.preempted_seq_ids == [bg2.seq_id]
    assert bg2.status == SequenceStatus.PREEMPTED and sched.waiting == [bg2]
    assert bg2.num_output_tokens == 1  # its output is kept: it recomputes, never resamples
    assert bg1.status == SequenceStatus.RUNNING
    out, _ = step(sched)
    assert chunks(out) == {fg.seq_id: 1, bg1.seq_id: 1}
    # once a seat frees, it resumes from its full prompt blocks in the prefix cache
    sched.finish_seqs([fg], SequenceStatus.FINISHED_STOPPED)
    out, _ = step(sched)
    assert chunks(out) == {bg1.seq_id: 1, bg2.seq_id: 1}  # 8 + 1 tokens, 8 of them cached
    assert bg2.status == SequenceStatus.RUNNING and bg2.num_output_tokens == 2


def test_foreground_sequences_never_take_seats_from_each_other() -> None:
    sched = make_scheduler(max_num_seqs=2, background_priority=BACKGROUND)
    fg1, fg2 = (add(sched, 4)[0] for _ in range(2))
    step(sched)
    (fg3,) = add(sched, 4)
    out, _ = step(sched)
    assert chunks(out) == {fg1.seq_id: 1, fg2.seq_id: 1}
    assert out.preempted_seq_ids == [] and sched.waiting == [fg3]


def test_seats_to_free_counts_free_seats_and_stops_at_foreground_work() -> None:
    sched = make_scheduler(max_num_seqs=3, background_priority=BACKGROUND)
    (fg,) = add(sched, 4)
    bg1, bg2 = (add(sched, 4, priority=BACKGROUND)[0] for _ in range(2))
    step(sched)
    waiting = [add(sched, 4)[0] for _ in range(4)]
    bands = sched.bands
    # four wait: each free seat spares a band sequence, the last ones go first, and the
    # foreground sequence running keeps its seat
    assert bands.seats_to_free(sched.running, sched.waiting, 3) == [bg2]
    assert bands.seats_to_free(sched.running, sched.waiting, 2) == [bg2, bg1]
    assert bands.seats_to_free(sched.running, sched.waiting, 0) == [bg2, bg1]
    assert bands.seats_to_free(sched.running, sched.waiting, 4) == []
    assert PriorityBands(None).seats_to_free(sched.running, waiting, 0) == []
    assert fg.status == SequenceStatus.RUNNING


def test_waiting_background_sequences_start_together_once_a_quarter_of_the_seats_is_free(
        ) -> None:
    """16 seats: while background sequences run, waiting ones start once 4 seats are free
    (or once they all fit), so the steps between stay pure decode steps."""
    sched = make_scheduler(background_priority=BACKGROUND, max_num_seqs=16)
    assert sched.bands.admit_seats == 4
    running = [add(sched, 2, priority=BACKGROUND, max_tokens=1 + i)[0] for i in range(16)]
    waiting = [add(sched, 2, priority=BACKGROUND, max_tokens=8)[0] for _ in range(10)]
    out, _ = step(sched)  # the 16 prompts; the first ends with its one token
    assert set(chunks(out)) == {seq.seq_id for seq in running}
    for free in (1, 2, 3):  # one more ends every step; the waiting ones wait
        out, _ = step(sched)
        assert set(chunks(out)) == {seq.seq_id for seq in running[free:]}
        assert set(chunks(out).values()) == {1}
    out, _ = step(sched)  # 4 free: four start at once, beside the 12 decodes
    assert {seq_id: n for seq_id, n in chunks(out).items() if n > 1} == {
        seq.seq_id: 2 for seq in waiting[:4]}
    assert sched.waiting == waiting[4:]


def test_the_last_background_sequences_start_as_soon_as_they_all_fit() -> None:
    sched = make_scheduler(background_priority=BACKGROUND, max_num_seqs=16)
    running = [add(sched, 2, priority=BACKGROUND, max_tokens=1 + i)[0] for i in range(16)]
    waiting = [add(sched, 2, priority=BACKGROUND, max_tokens=8)[0] for _ in range(2)]
    # (3 free seats would not do for 3 waiting ones; 2 do for 2)
    step(sched)  # one ends: 1 free seat, 2 waiting
    out, _ = step(sched)
    assert not set(chunks(out)) & {seq.seq_id for seq in waiting}
    out, _ = step(sched)  # 2 free, 2 waiting: both fit
    assert {seq_id: n for seq_id, n in chunks(out).items() if n > 1} == {
        seq.seq_id: 2 for seq in waiting}
    assert len(chunks(out)) == len(running) - 2 + 2


def test_small_groups_admit_background_sequences_into_any_free_seat() -> None:
    sched = make_scheduler(background_priority=BACKGROUND, max_num_seqs=4)
    assert sched.bands.admit_seats == 1
    [add(sched, 2, priority=BACKGROUND, max_tokens=1 + i) for i in range(4)]
    (late,) = add(sched, 2, priority=BACKGROUND, max_tokens=8)
    step(sched)  # one ends
    out, _ = step(sched)
    assert chunks(out)[late.seq_id] == 2
