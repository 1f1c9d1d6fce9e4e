"""What the dashboard reads: job listings with filters, counts, device groups, rate counters.

Every query is bounded: a page of at most MAX_PAGE_SIZE rows in keyset order
(`created_at DESC, id DESC`), counts grouped in the database. Counts by status and the
queued/running filters use the `(status, lease_expires_at)` index; a key's listing uses
`(api_key_id, created_at)`. NOTE: the jobs table has no index on `created_at` alone, so the
unscoped listing (auth off) scans the table and keeps the top rows: 6-35 ms at 10,000 jobs,
~130 ms at 100,000 on 2 cores (benchmarks/bench_dashboard.py); an index on
`(created_at, id)` would make it constant.

Nothing here knows about HTTP: the views in `webapp/dashboard.py` parse the request into a
`JobFilter` and render what comes back.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from redis import Redis
from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from tasks.broker_queue import queue_keys
from tasks.db import keyset_after, keyset_order
from tasks.metrics import JOB_STATUS_FIELD, metrics_key
from tasks.models import ApiKey, Job, JobStatus
from tasks.protocol import group_alive_key, groups_key
from tasks.settings import Settings

PROMPT_PREVIEW_CHARS = 160
# a heartbeat older than this marks its group unhealthy even while its alive key lives
STALE_AFTER_SECONDS = 10.0
# cumulative counters of `tasks.metrics` the page turns into rates (field -> our name)
RATE_COUNTERS = {
    "generation_tokens": "generation_tokens",
    "prompt_tokens": "prompt_tokens",
    "time_to_first_token:sum": "ttft_sum",
    "time_to_first_token:count": "ttft_count",
    "inter_token_latency:sum": "itl_sum",
    "inter_token_latency:count": "itl_count",
}

# a statement keeps its row type through `_scoped`
SelectT = TypeVar("SelectT", bound=Select)


@dataclass(slots=True)
class JobFilter:
    """One page of the jobs view: every field narrows the listing (None: no condition)."""

    owner: uuid.UUID | None  # the caller's key when auth is on: always applied
    auth_enabled: bool
    statuses: list[str] = field(default_factory=list)
    model: str | None = None
    kind: str | None = None
    key: str | None = None  # an API key's name or id
    created_after: datetime | None = None
    created_before: datetime | None = None
    limit: int = 25
    after: uuid.UUID | None = None  # keyset cursor: the last job id of the previous page


@dataclass(slots=True)
class JobPage:
    rows: list[dict[str, Any]]
    has_more: bool
    cursor_found: bool = True


def list_jobs(session: Session, flt: JobFilter) -> JobPage:
    """The newest jobs matching `flt`, one page, in keyset order."""
    # NOTE: the page is chosen on (created_at, id) alone and its rows fetched after: a
    # sort over every matching row then carries two narrow columns, not the row preview.
    chosen = (select(Job.id, Job.created_at)
              .order_by(*keyset_order(Job.created_at, Job.id))
              .limit(flt.limit + 1))
    chosen = _scoped(chosen, flt.owner, flt.auth_enabled)
    if flt.statuses:
        chosen = chosen.where(Job.status.in_(flt.statuses))
    if flt.model:
        chosen = chosen.where(Job.model == flt.model)
    if flt.kind:
        chosen = chosen.where(Job.kind == flt.kind)
    if flt.key:
        chosen = chosen.where(_key_matches(flt.key))
    if flt.created_after is not None:
        chosen = chosen.where(Job.created_at >= flt.created_after)
    if flt.created_before is not None:
        chosen = chosen.where(Job.created_at < flt.created_before)
    if flt.after is not None:
        cursor = session.execute(_scoped(select(Job.created_at, Job.id).where(
            Job.id == flt.after), flt.owner, flt.auth_enabled)).first()
        if cursor is None:
            return JobPage([], False, cursor_found=False)
        chosen = chosen.where(keyset_after(Job.created_at, Job.id, cursor))
    page = chosen.subquery()
    statement = (
        select(Job.id, Job.model, Job.kind, Job.status, Job.priority, Job.attempts, Job.worker,
               Job.finish_reason, func.substr(Job.prompt, 1, PROMPT_PREVIEW_CHARS),
               Job.prompt_tokens, Job.completion_tokens, Job.cached_tokens, Job.created_at,
               Job.started_at, Job.first_token_at, Job.finished_at, ApiKey.name, Job.messages)
        .join(page, page.c.id == Job.id)
        .outerjoin(ApiKey, ApiKey.id == Job.api_key_id)
        .order_by(page.c.created_at.desc(), page.c.id.desc())
    )
    result = session.execute(statement).all()
    rows = [_row(values) for values in result[:flt.limit]]
    return JobPage(rows, len(result) > flt.limit)


def status_counts(session: Session, owner: uuid.UUID | None,
                  auth_enabled: bool) -> dict[str, int]:
    """Jobs per status (every status present, zeros included) visible to the caller."""
    statement = select(Job.status, func.count()).group_by(Job.status)
    counts = {status.value: 0 for status in JobStatus}
    for status, count in session.execute(_scoped(statement, owner, auth_enabled)):
        counts[status] = int(count)
    return counts


def unfinished_by_model(session: Session) -> dict[str, dict[str, int]]:
    """Per model: queued and running jobs of every key (the cluster's load)."""
    statement = (select(Job.model, Job.status, func.count())
                 .where(Job.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]))
                 .group_by(Job.model, Job.status))
    found: dict[str, dict[str, int]] = {}
    for model, status, count in session.execute(statement):
        found.setdefault(model, {})[status] = int(count)
    return found


def read_redis_figures(redis: Redis, settings: Settings,
                       models: list[str]) -> dict[str, dict[str, Any]]:
    """Per model, from one pipeline: its groups' heartbeats (alive or not), the messages
    waiting in its broker queue, and the cumulative counters behind the rate charts."""
    pipe = redis.pipeline(transaction=False)
    for model in models:
        pipe.hgetall(groups_key(settings, model))
        pipe.hgetall(metrics_key(settings, model))
        for key in queue_keys(settings, model):
            pipe.llen(key)
    replies = pipe.execute()
    per_model: dict[str, dict[str, Any]] = {}
    width = 2 + len(queue_keys(settings, models[0])) if models else 0
    for index, model in enumerate(models):
        beats, counters, *lengths = replies[index * width:(index + 1) * width]
        per_model[model] = {"beats": beats, "counters": _decode(counters),
                            "broker_pending": int(sum(lengths))}
    pipe = redis.pipeline(transaction=False)
    candidates = [(model, raw_id.decode()) for model in models
                  for raw_id in per_model[model]["beats"]]
    for model, group_id in candidates:
        pipe.exists(group_alive_key(settings, model, group_id))
    alive = {c for c, exists in zip(candidates, pipe.execute()) if exists}
    now = time.time()
    for model in models:
        data = per_model[model]
        data["groups"] = [_group(model, raw_id.decode(), raw, (model, raw_id.decode()) in alive,
                                 now)
                          for raw_id, raw in sorted(data.pop("beats").items())]
        counters = data.pop("counters")
        rates = {name: float(counters.get(f, 0)) for f, name in RATE_COUNTERS.items()}
        rates["finished_jobs"] = float(sum(float(v) for k, v in counters.items()
                                           if k.startswith(JOB_STATUS_FIELD)))
        data["counters"] = rates
    return per_model


def _group(model: str, group_id: str, raw: bytes, alive: bool, now: float) -> dict[str, Any]:
    try:
        beat = json.loads(raw)
    except ValueError:
        beat = {}
    if not isinstance(beat, dict):
        beat = {}
    topology = beat.get("topology") or {}
    updated_at = beat.get("updated_at")
    age = now - float(updated_at) if isinstance(updated_at, (int, float)) else None
    # NOTE: the alive key's TTL is the worker's own verdict; the age guards a clock that
    # stopped beating while the key still lives (a hung heartbeat thread).
    fresh = age is not None and age < STALE_AFTER_SECONDS
    healthy = alive and fresh and not beat.get("draining", False)
    return {
        "id": group_id, "model": model, "alive": alive, "healthy": healthy,
        "draining": bool(beat.get("draining", False)),
        "devices": beat.get("devices") or topology.get("devices") or [],
        "tp_size": topology.get("tp_size", len(beat.get("devices") or []) or 1),
        "capacity": beat.get("capacity"),
        "num_running": beat.get("num_running", 0), "num_waiting": beat.get("num_waiting", 0),
        "num_jobs": beat.get("num_jobs", 0),
        "kv_cache_usage": beat.get("kv_cache_usage", 0.0),
        "hostname": beat.get("hostname"), "pid": beat.get("pid"),
        "updated_at": updated_at, "heartbeat_age_seconds": age,
    }


def job_request(session: Session, job: Job) -> dict[str, Any]:
    """What the job view adds to the API's job: the request, the worker, the key's name."""
    key_name = None
    if job.api_key_id is not None:
        key_name = session.scalar(select(ApiKey.name).where(ApiKey.id == job.api_key_id))
    return {
        "prompt": job.prompt, "messages": job.messages,
        "num_prompt_tokens": job.prompt_tokens, "worker": job.worker, "api_key": key_name,
        # every claim counts an attempt: the ones after the first are restarts
        "num_restarts": max(0, (job.attempts or 0) - 1),
        "lease_expires_at": _iso(job.lease_expires_at),
    }


def _scoped(statement: SelectT, owner: uuid.UUID | None, auth_enabled: bool) -> SelectT:
    return statement.where(Job.api_key_id == owner) if auth_enabled else statement


def _key_matches(key: str) -> Any:
    try:
        key_id = uuid.UUID(key)
    except ValueError:
        return Job.api_key_id.in_(select(ApiKey.id).where(ApiKey.name == key))
    return Job.api_key_id == key_id


def _row(values: Any) -> dict[str, Any]:
    (job_id, model, kind, status, priority, attempts, worker, finish_reason, preview,
     prompt_tokens, completion_tokens, cached_tokens, created_at, started_at, first_token_at,
     finished_at, key_name, messages) = values
    if messages:
        # a chat job's stored prompt is the template's rendering; its last message reads better
        preview = _message_text(messages[-1])[:PROMPT_PREVIEW_CHARS]
    return {
        "id": str(job_id), "model": model, "kind": kind, "status": status,
        "priority": priority, "attempts": attempts, "worker": worker,
        "finish_reason": finish_reason, "prompt_preview": preview, "api_key": key_name,
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens, "created_at": _iso(created_at),
        "queue_seconds": _seconds(created_at, started_at),
        "ttft_seconds": _seconds(started_at, first_token_at),
        "run_seconds": _seconds(started_at, finished_at),
    }


def _message_text(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):  # content parts: their text
        content = " ".join(str(part.get("text", "")) for part in content
                           if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 3)


def _decode(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}
