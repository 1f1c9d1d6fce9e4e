"""`TokenCoalescer`: merged token events keep every token, in order, per sample."""

from __future__ import annotations

import pytest

from tasks.protocol import EventType, JobEvent
from workers.token_coalescer import TokenCoalescer


def _token(index: int, token_id: int, logprob: float | None = None) -> JobEvent:
    return JobEvent(EventType.TOKEN, index=index, text=f"<{token_id}>", token_ids=[token_id],
                    logprobs=None if logprob is None else [{"token_id": token_id,
                                                            "logprob": logprob, "top": []}])


def test_events_go_out_merged_every_num_tokens_per_sample() -> None:
    coalescer = TokenCoalescer(3)
    out = [coalescer.add(_token(i % 2, 10 + i, -float(i)), float(i)) for i in range(8)]
    # samples 0 and 1 take turns: sample 0 fills its event with token 14, sample 1 with 15
    assert [None if e is None else e.index for e in out] == [
        None, None, None, None, 0, 1, None, None]
    first, second = out[4], out[5]
    assert first.text == "<10><12><14>" and first.token_ids == [10, 12, 14]
    assert [lp["logprob"] for lp in first.logprobs] == [0.0, -2.0, -4.0]
    assert second.token_ids == [11, 13, 15]
    rest = coalescer.flush()
    assert [(e.index, e.token_ids, e.text) for e in rest] == [(0, [16], "<16>"),
                                                              (1, [17], "<17>")]
    assert coalescer.flush() == []


def test_an_event_without_tokens_keeps_its_text() -> None:
    coalescer = TokenCoalescer(4)
    assert coalescer.add(JobEvent(EventType.TOKEN, text="a", token_ids=[1]), 0.0) is None
    assert coalescer.add(JobEvent(EventType.TOKEN, text="b", token_ids=[]), 9.0) is None
    (event,) = coalescer.flush()
    assert event.text == "ab" and event.token_ids == [1] and event.logprobs is None


def test_by_interval_the_first_token_goes_at_once_then_one_event_per_interval() -> None:
    coalescer = TokenCoalescer(interval=0.02)
    sent = coalescer.add(_token(0, 1), 100.0)
    assert sent is not None and sent.token_ids == [1]  # the first token is not held
    assert coalescer.add(_token(0, 2), 100.004) is None
    assert coalescer.add(_token(0, 3), 100.008) is None
    assert coalescer.due(100.019) == [] and coalescer.holding
    # the next token after the interval carries the held ones
    sent = coalescer.add(_token(0, 4), 100.021)
    assert sent is not None and sent.token_ids == [2, 3, 4] and sent.text == "<2><3><4>"
    assert not coalescer.holding
    # a sample the steps leave out is not left holding: `due` hands its tokens on
    assert coalescer.add(_token(0, 5), 100.025) is None
    assert coalescer.due(100.030) == []
    (late,) = coalescer.due(100.042)
    assert late.token_ids == [5] and not coalescer.holding
    # after a pause longer than the interval, a token goes at once
    assert coalescer.add(_token(0, 6), 101.0).token_ids == [6]


def test_by_interval_each_sample_keeps_its_own_clock() -> None:
    coalescer = TokenCoalescer(interval=0.01)
    assert coalescer.add(_token(0, 1), 5.0).token_ids == [1]
    assert coalescer.add(_token(0, 2), 5.001) is None
    assert coalescer.add(_token(1, 7), 5.002).token_ids == [7]  # sample 1's first token
    assert coalescer.add(_token(1, 8), 5.003) is None
    assert [(e.index, e.token_ids) for e in coalescer.due(5.0115)] == [(0, [2])]
    assert [(e.index, e.token_ids) for e in coalescer.flush()] == [(1, [8])]


def test_a_coalescer_takes_one_rule() -> None:
    with pytest.raises(ValueError):
        TokenCoalescer()
    with pytest.raises(ValueError):
        TokenCoalescer(4, interval=0.1)
