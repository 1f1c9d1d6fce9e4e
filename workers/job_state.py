"""What the batcher knows about one running job: its samples' text, tokens and ends.

Turns engine deltas into stream events and, at the end, into the `JobResult` the writer
stores. Lives in the batcher thread only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tasks.metrics import JobFigures
from tasks.models import JobErrorKind, JobStatus
from tasks.protocol import EventType, JobEvent
from workers.admitted import AdmittedJob
from workers.engine.outputs import CompletionDelta, FinishReason
from workers.job_rows import JobProgress, JobResult
from workers.token_coalescer import TokenCoalescer

# NOTE: Postgres text cannot hold NUL. A NUL the model emits reaches the client as U+FFFD,
# the same in the stream and in the stored output (token ids stay exact).
NUL_REPLACEMENT = "\ufffd"


class JobState:
    """Accumulated output of one job (n samples)."""

    __slots__ = ("job", "texts", "token_ids", "finish_reasons", "num_prompt_tokens",
                 "num_cached_tokens", "first_token_at", "error", "error_kind", "coalescer")

    def __init__(self, job: AdmittedJob, coalescer: TokenCoalescer | None = None) -> None:
        """`coalescer`: token events are merged by its rule (workers/token_coalescer.py);
        `held_events` returns what it still holds at the end."""
        n = job.num_samples
        self.job = job
        self.texts: list[list[str]] = [[] for _ in range(n)]  # text pieces per sample
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.num_prompt_tokens = len(job.prompt) if isinstance(job.prompt, list) else 0
        self.num_cached_tokens = 0
        self.first_token_at: datetime | None = None
        self.error: str | None = None
        self.error_kind: JobErrorKind | None = None  # set with `error`
        self.coalescer = coalescer

    @property
    def all_finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    @property
    def has_output(self) -> bool:
        return bool(self.token_ids[0])

    def apply(self, delta: CompletionDelta, now: float) -> JobEvent | None:
        """Record `delta` (produced at `now`, monotonic seconds); return the token event to
        publish, if it carries anything and is not held."""
        index = delta.index
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        text = delta.text.replace("\x00", NUL_REPLACEMENT) if delta.text else ""
        if text:
            self.texts[index].append(text)
        self.token_ids[index].extend(delta.new_token_ids)
        if delta.finished and self.finish_reasons[index] is None:
            reason = delta.finish_reason or FinishReason.STOP
            self.finish_reasons[index] = reason.value
            if reason is FinishReason.ERROR and self.error is None:
                # the engine failed this request alone: a grammar that did not compile is
                # the request's fault; a step that raised for it is the service's (it
                # passed the API's checks)
                self.error = delta.error or "the model step failed for this request"
                self.error_kind = (JobErrorKind.INVALID_REQUEST if delta.caused_by_request
                                   else JobErrorKind.SERVER_ERROR)
        if not delta.new_token_ids and not delta.text:
            return None
        if self.coalescer is not None:
            return self.coalescer.add_tokens(index, text, delta.new_token_ids,
                                             _logprobs_payload(delta), now)
        return JobEvent(
            EventType.TOKEN,
            index=index,
            text=text,
            token_ids=list(delta.new_token_ids),
            logprobs=_logprobs_payload(delta),
        )

    def held_events(self) -> list[JobEvent]:
        """The token events still held by coalescing (publish them before the terminal
        event); none after."""
        return self.coalescer.flush() if self.coalescer is not None else []

    def cancel_all(self) -> None:
        for i, reason in enumerate(self.finish_reasons):
            if reason is None:
                self.finish_reasons[i] = FinishReason.CANCELLED.value

    def fail(self, reason: str, kind: JobErrorKind = JobErrorKind.SERVER_ERROR) -> None:
        """End every unfinished sample with `reason`; `kind`: whose fault it is."""
        self.error = reason
        self.error_kind = kind
        for i, finish in enumerate(self.finish_reasons):
            if finish is None:
                self.finish_reasons[i] = FinishReason.ERROR.value

    def progress(self) -> JobProgress:
        return JobProgress(
            job_id=self.job.job_id,
            output_text="".join(self.texts[0]),
            completion_tokens=sum(len(t) for t in self.token_ids),
            attempt=self.job.attempt,
            first_token_at=self.first_token_at,
        )

    def result(self) -> JobResult:
        """The terminal row and event. error > cancelled > done."""
        if self.error is not None:
            status, event_type = JobStatus.FAILED, EventType.ERROR
        elif FinishReason.CANCELLED.value in self.finish_reasons:
            status, event_type = JobStatus.CANCELLED, EventType.CANCELLED
        else:
            status, event_type = JobStatus.SUCCEEDED, EventType.DONE
        finish_reason = (FinishReason.ERROR.value if self.error is not None
                         else FinishReason.CANCELLED.value if status is JobStatus.CANCELLED
                         else self.finish_reasons[0])
        completion_tokens = sum(len(t) for t in self.token_ids)
        usage = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.num_prompt_tokens + completion_tokens,
            "cached_tokens": self.num_cached_tokens,
        }
        texts = ["".join(pieces) for pieces in self.texts]
        output: list[dict[str, Any]] = [
            {"index": i, "text": texts[i], "finish_reason": self.finish_reasons[i],
             "token_ids": self.token_ids[i]}
            for i in range(len(texts))
        ]
        event = JobEvent(event_type, finish_reason=finish_reason, error=self.error, usage=usage)
        return JobResult(
            job_id=self.job.job_id,
            status=status,
            finish_reason=finish_reason,
            error=self.error,
            output=output,
            output_text=texts[0],
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=self.num_cached_tokens,
            event=event,
            first_token_at=self.first_token_at,
            attempt=self.job.attempt,
            error_kind=self.error_kind if self.error is not None else None,
            batch_id=self.job.batch_id,
        )

    def figures(self, result: JobResult) -> JobFigures:
        """The metrics of this job once it ended with `result`."""
        first = self.first_token_at
        return JobFigures(
            status=result.status.value, num_prompt_tokens=result.prompt_tokens,
            num_completion_tokens=result.completion_tokens,
            num_samples=len(result.output) or 1,
            created_at=self.job.created_at, claimed_at=self.job.claimed_at,
            first_token_at=first.timestamp() if first is not None else None,
            finished_at=result.finished_at.timestamp(),
        )


def _logprobs_payload(delta: CompletionDelta) -> list[dict[str, Any]] | None:
    if not delta.logprobs:
        return None
    return [
        {"token_id": lp.token_id, "logprob": lp.logprob,
         "top": [[token_id, logprob] for token_id, logprob in lp.top]}
        for lp in delta.logprobs
    ]
