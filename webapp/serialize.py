"""Job rows -> JSON for the API (the same shape for create, get and list)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tasks.models import Job, JobStatus


def job_links(job_id: str) -> dict[str, str]:
    base = f"/v1/jobs/{job_id}"
    return {"self": base, "events": base + "/events", "cancel": base + "/cancel"}


def job_to_dict(job: Job, live_output: dict[int, str] | None = None) -> dict[str, Any]:
    """The public view of a job.

    `live_output` is the text so far per sample while the job runs (from its event
    stream); without it the row's own output is used.
    """
    job_id = str(job.id)
    n = int((job.params or {}).get("n", 1))
    choices: list[dict[str, Any]]
    if job.output:
        choices = [dict(choice) for choice in job.output]
    elif live_output is not None:
        choices = [{"index": i, "text": live_output.get(i, ""), "finish_reason": None}
                   for i in range(n)]
    elif job.output_text is not None:
        choices = [{"index": 0, "text": job.output_text, "finish_reason": job.finish_reason}]
    else:
        choices = []
    text = next((c.get("text") for c in choices if c.get("index", 0) == 0), None)
    return {
        "id": job_id,
        "object": "job",
        "model": job.model,
        "kind": job.kind,
        "status": job.status,
        "priority": job.priority,
        "attempts": job.attempts,
        "params": job.params,
        "text": text,
        "choices": choices,
        "finish_reason": job.finish_reason,
        "error": job.error,
        "error_kind": job.error_kind,
        "request_id": job.request_id,
        "usage": _usage(job),
        "timings": _timings(job),
        "created_at": _iso(job.created_at),
        "links": job_links(job_id),
        "batch_id": job.batch_id,
        "custom_id": job.custom_id,
    }


def _usage(job: Job) -> dict[str, int] | None:
    if job.prompt_tokens is None and job.completion_tokens is None:
        return None
    prompt = job.prompt_tokens or 0
    completion = job.completion_tokens or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "cached_tokens": job.cached_tokens or 0}


def _timings(job: Job) -> dict[str, Any]:
    timings: dict[str, Any] = {
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "first_token_at": _iso(job.first_token_at),
        "finished_at": _iso(job.finished_at),
        # seconds; None until the moments exist
        "queue_seconds": _seconds(job.created_at, job.started_at),
        "time_to_first_token_seconds": _seconds(job.started_at, job.first_token_at),
        "run_seconds": _seconds(job.started_at, job.finished_at),
        "total_seconds": _seconds(job.created_at, job.finished_at),
    }
    return timings


def is_terminal(job: Job) -> bool:
    return JobStatus(job.status).is_terminal


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 6)
