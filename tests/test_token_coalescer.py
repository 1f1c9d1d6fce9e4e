"""`TokenCoalescer`: merged token events keep every token, in order, per sample."""

from __future__ import annotations

from tasks.protocol import EventType, JobEvent
from workers.token_coalescer import TokenCoalescer


def _token(index: int, token_id: int, logprob: float | None = None) -> JobEvent:
    return JobEvent(EventType.TOKEN, index=index, text=f"<{token_id}>", token_ids=[token_id],
                    logprobs=None if logprob is None else [{"token_id": token_id,
                                                            "logprob": logprob, "top": []}])


def test_events_go_out_merged_every_num_tokens_per_sample() -> None:
    coalescer = TokenCoalescer(3)
    out = [coalescer.add(_token(i % 2, 10 + i, -float(i))) for i in range(8)]
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
    assert coalescer.add(JobEvent(EventType.TOKEN, text="a", token_ids=[1])) is None
    assert coalescer.add(JobEvent(EventType.TOKEN, text="b", token_ids=[])) is None
    (event,) = coalescer.flush()
    assert event.text == "ab" and event.token_ids == [1] and event.logprobs is None
