"""The batcher thread's nice value (workers/thread_priority.py): taken only where the
engine leaves cores to the rest of the host, per thread, inherited by the threads it
starts, and a refusal leaves the default."""

from __future__ import annotations

import logging
import os
import sys
import threading

import pytest

from workers.thread_priority import batcher_nice, set_this_thread_nice, this_thread_nice

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a nice value per thread is Linux's")


def test_a_raised_priority_is_taken_only_where_the_engine_leaves_cores():
    assert batcher_nice(-20, 1, 2)[0] == -20
    assert batcher_nice(-5, 3, 4)[0] == -5
    nice, why = batcher_nice(-20, 2, 2)
    assert nice == 0 and "every one of the 2 cores" in why
    assert batcher_nice(-20, 8, 4)[0] == 0
    assert batcher_nice(0, 1, 2)[0] == 0
    assert batcher_nice(5, 8, 2)[0] == 5  # a lower priority starves nobody
    for bad in (-21, 20):
        with pytest.raises(ValueError, match="between -20 and 19"):
            batcher_nice(bad, 1, 2)


@linux_only
def test_the_value_is_the_calling_threads_and_threads_it_starts_inherit_it():
    main_before = this_thread_nice()
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = this_thread_nice()

    def run() -> None:
        seen["ok"] = int(set_this_thread_nice(main_before + 3))
        seen["self"] = this_thread_nice()
        started = threading.Thread(target=child)
        started.start()
        started.join()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == {"ok": 1, "self": main_before + 3, "child": main_before + 3}
    assert this_thread_nice() == main_before  # the process's other threads keep theirs


@linux_only
def test_a_refused_value_leaves_the_default_and_says_so(monkeypatch, caplog):
    def refuse(which: int, who: int, value: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    before = this_thread_nice()
    monkeypatch.setattr(os, "setpriority", refuse)
    with caplog.at_level(logging.INFO, logger="workers.thread_priority"):
        assert set_this_thread_nice(-20) is False
    assert this_thread_nice() == before
    assert "keeps its default priority" in caplog.text and "CAP_SYS_NICE" in caplog.text
