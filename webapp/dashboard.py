"""The dashboard: `GET /` serves the page; `/v1/dashboard/*` the few reads the public API
does not offer (filtered job listings, counts, device groups, rate counters).

The page (`webapp/templates/dashboard.html`, `webapp/static/dashboard/`) is plain HTML and
JavaScript modules shipped in the package: no CDN, no build step. Everything else it shows
comes from the API a client uses (`/v1/jobs`, its events, `/v1/models`). With auth on the
page sends the key the user typed as `Authorization: Bearer`, so the dashboard sees
exactly what that key sees; the endpoints here scope by key the same way.
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime
from pathlib import Path

import redis
from flask import Blueprint, Response, jsonify, render_template, request, url_for

from tasks.models import JobKind, JobStatus
from webapp import dashboard_data
from webapp.auth import current_api_key_id
from webapp.errors import APIError
from webapp.jobs import load_job
from webapp.serialize import job_to_dict
from webapp.services import services

logger = logging.getLogger(__name__)

bp = Blueprint("dashboard", __name__, template_folder="templates", static_folder="static",
               static_url_path="/static")

DEFAULT_PAGE_SIZE = 25
MAX_PAGE_SIZE = 100
STATIC_DIR = Path(__file__).resolve().parent / "static" / "dashboard"


@bp.get("/")
def page() -> str:
    """The dashboard page; its scripts do the rest."""
    settings = services().settings
    return render_template("dashboard.html", auth_enabled=settings.auth_enabled,
                           static=_static_url, models=sorted(settings.models),
                           statuses=[s.value for s in JobStatus],
                           kinds=[k.value for k in JobKind])


@bp.get("/v1/dashboard/jobs")
def jobs() -> Response:
    """One page of jobs, newest first. Filters: `status` (comma list), `model`, `kind`,
    `key` (an API key's name or id), `created_after` / `created_before` (ISO 8601);
    paging: `limit`, `after=<last_id of the previous page>`."""
    svc = services()
    args = request.args
    flt = dashboard_data.JobFilter(
        owner=current_api_key_id(), auth_enabled=svc.settings.auth_enabled,
        statuses=_statuses(args.get("status")), model=args.get("model") or None,
        kind=_kind(args.get("kind")), key=(args.get("key") or "").strip() or None,
        created_after=_moment(args.get("created_after"), "created_after"),
        created_before=_moment(args.get("created_before"), "created_before"),
        limit=_limit(args.get("limit")), after=_cursor(args.get("after")))
    with svc.reads() as session:
        page_ = dashboard_data.list_jobs(session, flt)
    if not page_.cursor_found:
        raise APIError(400, "invalid_cursor", "after must be the id of a job from a previous "
                       "page of this listing", "after")
    return jsonify({"object": "list", "data": page_.rows, "has_more": page_.has_more,
                    "last_id": page_.rows[-1]["id"] if page_.rows else None})


@bp.get("/v1/dashboard/jobs/<job_id>")
def job(job_id: str) -> Response:
    """The job as `GET /v1/jobs/<id>` answers it, plus its request, worker and key."""
    row = load_job(job_id)
    body = job_to_dict(row)
    with services().reads() as session:
        body["request"] = dashboard_data.job_request(session, row)
    return jsonify(body)


@bp.get("/v1/dashboard/summary")
def summary() -> Response:
    """Counts per status (the caller's jobs), and per model: queued and running jobs, the
    broker's waiting messages, device groups from heartbeats, and the cumulative counters
    the page samples to draw rates (tokens, finished jobs, TTFT and inter-token sums)."""
    svc = services()
    owner = current_api_key_id()
    names = svc.models.names()
    with svc.reads() as session:
        counts = dashboard_data.status_counts(session, owner, svc.settings.auth_enabled)
        unfinished = dashboard_data.unfinished_by_model(session)
    try:
        figures = dashboard_data.read_redis_figures(svc.redis, svc.settings, names)
    except redis.RedisError as exc:
        # The database half still answers; the page shows the groups as unknown.
        logger.warning("dashboard summary: redis unreachable: %s", exc)
        figures = {}
    models = []
    for name in names:
        found = figures.get(name)
        models.append({
            "name": name,
            "queued": unfinished.get(name, {}).get(JobStatus.QUEUED.value, 0),
            "running": unfinished.get(name, {}).get(JobStatus.RUNNING.value, 0),
            "broker_pending": found["broker_pending"] if found else None,
            "groups": found["groups"] if found else None,
            "counters": found["counters"] if found else None,
        })
    return jsonify({"object": "dashboard.summary", "time": datetime.now(UTC).timestamp(),
                    "auth_enabled": svc.settings.auth_enabled, "counts": counts,
                    "models": models})


def _static_url(filename: str) -> str:
    """A static file's URL with its modification time, so a new release is never cached."""
    try:
        version = int((STATIC_DIR / filename).stat().st_mtime)
    except OSError:
        version = 0
    return url_for("dashboard.static", filename=f"dashboard/{filename}", v=version)


def _statuses(raw: str | None) -> list[str]:
    statuses = [s.strip() for s in (raw or "").split(",") if s.strip()]
    known = {s.value for s in JobStatus}
    bad = [s for s in statuses if s not in known]
    if bad:
        raise APIError(400, "invalid_value", f"unknown status {bad[0]!r}; use one of "
                       f"{', '.join(sorted(known))}", "status")
    return statuses


def _kind(raw: str | None) -> str | None:
    if not raw:
        return None
    if raw not in {k.value for k in JobKind}:
        raise APIError(400, "invalid_value", f"unknown kind {raw!r}; use one of "
                       f"{', '.join(k.value for k in JobKind)}", "kind")
    return raw


def _moment(raw: str | None, param: str) -> datetime | None:
    if not raw:
        return None
    try:
        moment = datetime.fromisoformat(raw.strip())
    except ValueError:
        raise APIError(400, "invalid_value", f"{param} must be an ISO 8601 time such as "
                       f"2026-01-31T12:00:00Z, not {raw!r}", param) from None
    # NOTE: a time without a zone is UTC, like every stored timestamp
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_PAGE_SIZE
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE_SIZE:
        raise APIError(400, "invalid_value", f"limit must be an integer from 1 to "
                       f"{MAX_PAGE_SIZE}", "limit")
    return int(raw)


def _cursor(raw: str | None) -> uuid.UUID | None:
    if not raw:
        return None
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise APIError(400, "invalid_cursor", "after must be the id of a job from a previous "
                       "page of this listing", "after") from None
