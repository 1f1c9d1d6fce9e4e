"""The batcher's inbox (admission ledger, back-pressure, the loop's take) and its cancel
memory, on their own: no engine, no Redis, no Postgres."""

from __future__ import annotations

import threading
import time

import pytest

from tasks.params import SamplingParams
from workers.admitted import AdmittedJob
from workers.cancel_requests import EARLY_CANCEL_SECONDS, PRUNE_ABOVE, CancelRequests
from workers.inbox import JobInbox


def _job(job_id: str, n: int = 1) -> AdmittedJob:
    return AdmittedJob(job_id=job_id, prompt="x", params=SamplingParams(n=n, max_tokens=1))


def _admit_in_thread(inbox: JobInbox, job: AdmittedJob) -> tuple[threading.Thread, list[bool]]:
    taken: list[bool] = []
    thread = threading.Thread(target=lambda: taken.append(inbox.admit(job)), daemon=True)
    thread.start()
    return thread, taken


def test_admit_counts_samples_and_take_hands_jobs_over_in_order():
    inbox = JobInbox(capacity=4)
    assert inbox.admit(_job("a", n=2)) and inbox.admit(_job("b"))
    assert inbox.figures() == (2, 3)
    assert inbox.wait(0.0)
    work = inbox.take()
    assert [j.job_id for j in work.jobs] == ["a", "b"]
    assert work.cancels == set() and work.cancelled_jobs == set() and not work.stopping
    # taken jobs still count until released: they run in the engine
    assert inbox.figures() == (2, 3) and not inbox.wait(0.0)
    inbox.release(work.jobs[:1])
    assert inbox.figures() == (1, 1)


def test_a_full_group_blocks_admit_until_a_job_is_released():
    inbox = JobInbox(capacity=2)
    first = _job("a", n=2)
    assert inbox.admit(first)
    assert not inbox.admit(_job("late"), timeout=0.05)  # full: not taken, caller requeues
    thread, taken = _admit_in_thread(inbox, _job("b"))
    time.sleep(0.1)
    assert taken == [] and inbox.figures() == (1, 2)
    inbox.release([first])
    thread.join(5)
    assert taken == [True] and inbox.figures() == (1, 1)


def test_a_job_bigger_than_the_capacity_runs_alone():
    inbox = JobInbox(capacity=2)
    assert inbox.admit(_job("big", n=5), timeout=0.0)
    assert not inbox.admit(_job("next"), timeout=0.05)


def test_a_cancel_releases_its_waiting_job_and_the_take_marks_it():
    inbox = JobInbox(capacity=1)
    assert inbox.admit(_job("running"))
    thread, taken = _admit_in_thread(inbox, _job("waiting"))
    time.sleep(0.05)
    inbox.cancel("waiting")
    thread.join(5)
    assert taken == [True]
    work = inbox.take()
    assert work.cancels == {"waiting"}
    assert work.cancelled_jobs == {"waiting"}  # the loop ends it without running it
    assert inbox.take().cancels == set()  # new requests are taken once


def test_stop_admitting_releases_blocked_admits_and_refuses_new_ones():
    inbox = JobInbox(capacity=1)
    assert inbox.admit(_job("a"))
    thread, taken = _admit_in_thread(inbox, _job("b"))
    time.sleep(0.05)
    inbox.stop_admitting()
    thread.join(5)
    assert taken == [False] and not inbox.admit(_job("c"))
    assert inbox.figures() == (1, 1)


def test_drain_waits_for_the_ledger_then_stop_reaches_the_loop():
    inbox = JobInbox(capacity=2)
    job = _job("a")
    assert inbox.admit(job)
    assert not inbox.wait_empty(time.monotonic() + 0.05)
    threading.Timer(0.05, inbox.release, ([job],)).start()
    assert inbox.wait_empty(time.monotonic() + 5.0)
    inbox.take()
    assert not inbox.wait(0.0)
    inbox.stop()
    assert inbox.wait(0.0) and inbox.take().stopping
    inbox.release_all()
    assert inbox.figures() == (0, 0)


@pytest.mark.alone
def test_wait_wakes_on_work_from_another_thread():
    inbox = JobInbox(capacity=2)
    threading.Timer(0.05, inbox.cancel, ("x",)).start()
    started = time.monotonic()
    assert inbox.wait(5.0)
    assert time.monotonic() - started < 2.0


def test_cancel_memory_is_pruned_only_when_large_and_keeps_recent_requests():
    cancels = CancelRequests()
    cancels.add("old", now=0.0)
    cancels.prune(now=EARLY_CANCEL_SECONDS + 1.0)
    assert "old" in cancels  # small: kept
    for i in range(PRUNE_ABOVE):
        cancels.add(f"recent-{i}", now=EARLY_CANCEL_SECONDS)
    assert cancels.take_new() >= {"old", "recent-0"} and not cancels.has_new
    cancels.prune(now=EARLY_CANCEL_SECONDS + 1.0)
    assert "old" not in cancels and "recent-0" in cancels
    assert len(cancels) == PRUNE_ABOVE


def test_an_interactive_admission_is_seen_until_the_loop_takes_it():
    """What the engine asks between layers of a batch-only step (Engine.set_step_yield)."""
    from tasks.api.batches import BATCH_PRIORITY

    inbox = JobInbox(capacity=4)
    line = AdmittedJob(job_id="line", prompt="x", params=SamplingParams(max_tokens=1),
                       priority=BATCH_PRIORITY)
    assert inbox.admit(line) and not inbox.interactive_waiting()  # a batch line: no
    assert inbox.admit(_job("question")) and inbox.interactive_waiting()
    inbox.take()
    assert not inbox.interactive_waiting()
