"""A device group's claims: the conditional UPDATEs that move queued job rows to running,
and the cancel flags of what they claimed.

Three statements, each built once with bound parameters (building the UPDATE and its
subquery was half a claim's CPU, 0.5-0.8 ms of SQLAlchemy):
* `one`: the message's job;
* `with_ahead`: the message's job and up to `limit` other queued interactive jobs of the
  model, highest priority and oldest first (claims ahead, workers/admission.py);
* `lines`: up to `limit` queued batch lines of the model, oldest batch first and in line
  order (the batch feeder).

`JobClaims` runs them where it lives. The worker does not: its claims run in the group's
database process (workers/db_process.py), which holds this object, so a claim's Python
never waits for (or delays) the batcher thread's GIL; admission gets the rows back as
plain `ClaimedRow`s. Every claimed row is `own`ed at once, so its lease is renewed from
the moment it is running.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, NamedTuple, Protocol

from sqlalchemy import (
    ColumnElement,
    DateTime,
    Integer,
    String,
    Uuid,
    and_,
    any_,
    bindparam,
    cast,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.dml import ReturningUpdate
from sqlalchemy.sql.selectable import CTE

from tasks.db import create_db_engine, utcnow
from tasks.models import Job, JobStatus, job_status_is
from tasks.protocol import cancel_flag_key
from tasks.settings import Settings

logger = logging.getLogger(__name__)


class ClaimedRow(NamedTuple):
    """What a claim returns of one row (picklable: it crosses from the database process)."""

    id: uuid.UUID
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: dict[str, Any] | None
    priority: int | None
    attempts: int
    created_at: datetime | None
    batch_id: str | None  # the batch it is a line of (None: an interactive job)
    cancel_requested: bool  # its cancel flag was set when it was claimed


class ClaimUnavailable(Exception):
    """The database process did not run a claim (Postgres refused it there, or the
    process is gone). Rows it may have claimed before going away are owned by nobody:
    their leases run out and beat queues them again."""


class FlagPipeline(Protocol):
    def exists(self, *names: str) -> object: ...  # its reply: truthy when a flag is set

    def execute(self) -> list[Any]: ...


class CancelFlags(Protocol):
    """The Redis client claims read cancel flags with (`redis.Redis`)."""

    def pipeline(self, transaction: bool = True) -> FlagPipeline: ...


class Claims(Protocol):
    """`JobClaims`, or the database process's handle that runs them there."""

    def one(self, job_id: uuid.UUID) -> list[ClaimedRow]: ...

    def with_ahead(self, job_id: uuid.UUID, model: str, limit: int) -> list[ClaimedRow]: ...

    def lines(self, model: str, limit: int) -> list[ClaimedRow]: ...


# the claims' own Postgres connections plan without explicit sorts or sequential scans
# (see create_claims_engine)
CLAIM_CONNECTION_OPTIONS = "-c enable_sort=off -c enable_seqscan=off"


def create_claims_engine(url: str, pool_size: int) -> Engine:
    """The engine a group's claims run on (`JobClaims`, in its database process).

    Postgres: its connections plan with `enable_sort=off` and `enable_seqscan=off`. A
    claim takes the first few queued jobs in an order one of the partial indexes keeps
    (the batch lines', the queued interactive jobs'), then updates them by primary key;
    where the table's statistics lag behind a batch's burst of lines (estimated 1 row,
    13,000 real) or misjudge how many rows are both queued and batch lines (they multiply
    the two shares), the planner read every queued line of the model through another
    index and sorted them (20 ms a claim of 16 with 13,000 lines queued, 41 s of Postgres
    over a 50,000-line batch), or, taking the table for a small one, scanned all of it for
    the rows to update. Without sorts and sequential scans to choose, it reads the few
    rows it takes off the indexes. (Both settings only price those plans out: where
    nothing else can run a statement, Postgres still sorts or scans.)"""
    return create_db_engine(url, pool_size=pool_size, max_overflow=1,
                            postgres_options=CLAIM_CONNECTION_OPTIONS)


class JobClaims:
    """The claim statements of group `group_id`, run on `session_factory`'s engine."""

    def __init__(self, settings: Settings, session_factory: sessionmaker[Session],
                 redis: CancelFlags, group_id: str, own: Callable[[str, int], None]) -> None:
        self.settings = settings
        self.redis = redis
        self.group_id = group_id
        self.own = own  # starts the lease renewal of a claimed attempt
        self._bind = session_factory.kw["bind"].execution_options(
            isolation_level="AUTOCOMMIT")
        job_id = bindparam("claim_job_id", type_=Uuid)
        limit = bindparam("claim_limit", type_=Integer)
        model = bindparam("claim_model", type_=String)
        ahead = _next_queued(
            and_(Job.model == model, Job.batch_id.is_(None), Job.id != job_id),
            (Job.priority, Job.created_at), limit, "claimed_ahead")
        lines = _next_queued(and_(Job.model == model, Job.batch_id.is_not(None)),
                             (Job.created_at, Job.batch_index), limit, "next_lines")
        if self._bind.dialect.name == "postgresql":
            # the message's job locked as the others are (waiting for a lock, not skipping),
            # found by its id alone: its status is checked on the locked row
            mine = (select(Job.id, Job.status).where(Job.id == job_id)
                    .with_for_update().cte("claimed").prefix_with("MATERIALIZED"))
            queued = mine.c.status == JobStatus.QUEUED.value
            self._one = self._statement(Job.id == any_(_ids(mine, queued)), locked=True)
            self._with_ahead = self._statement(
                Job.id == any_(func.array_cat(_ids(mine, queued), _ids(ahead))), locked=True)
            self._lines = self._statement(Job.id == any_(_ids(lines)), locked=True)
        else:
            self._one = self._statement(Job.id == job_id)
            self._with_ahead = self._statement(or_(Job.id == job_id,
                                                   Job.id.in_(select(ahead.c.id))))
            self._lines = self._statement(Job.id.in_(select(lines.c.id)))

    def one(self, job_id: uuid.UUID) -> list[ClaimedRow]:
        return self._claim(self._one, claim_job_id=job_id)

    def with_ahead(self, job_id: uuid.UUID, model: str, limit: int) -> list[ClaimedRow]:
        return self._claim(self._with_ahead, claim_job_id=job_id, claim_model=model,
                           claim_limit=limit)

    def lines(self, model: str, limit: int) -> list[ClaimedRow]:
        return self._claim(self._lines, claim_model=model, claim_limit=max(1, limit))

    def _statement(self, which: ColumnElement[bool],
                   locked: bool = False) -> ReturningUpdate[Any]:
        """The claim of the jobs `which` selects that are still queued; executed with
        `claim_now` and `claim_lease` (and `which`'s own parameters).

        `locked`: `which` selects only rows its subqueries locked as queued (Postgres:
        a row locked FOR UPDATE had its condition checked again on its latest version, and
        stays as it is until this statement commits), so the UPDATE finds them by primary
        key alone. Checking `status` here too let Postgres walk every queued job of the
        model instead (a queued batch's lines included): as `id IN (<the ids>)` or
        `id = :job OR ...`, a hash semi-join over the queued-jobs index or a sequential
        scan; with `id = ANY(...)` beside it, a bitmap scan of that index where its
        statistics lagged behind a batch's burst of lines. So a claim cost time in
        proportion to the queue: an interactive job's claim 9-11 ms with 50,000 lines
        queued; the feeder's claim of 8 lines 11 ms with 20,000 (docs/benchmarks.md,
        "Claims by primary key")."""
        return (
            update(Job)
            .where(which, *(() if locked else (Job.status == JobStatus.QUEUED.value,)))
            .values(
                status=JobStatus.RUNNING.value,
                worker=self.group_id,
                started_at=bindparam("claim_now", type_=DateTime(timezone=True)),
                lease_expires_at=bindparam("claim_lease", type_=DateTime(timezone=True)),
                attempts=Job.attempts + 1,
                finish_reason=None,
                error=None,
            )
            .returning(Job.id, Job.prompt, Job.prompt_token_ids, Job.params, Job.priority,
                       Job.attempts, Job.created_at, Job.batch_id)
        )

    def _claim(self, statement: ReturningUpdate[Any], **params: Any) -> list[ClaimedRow]:
        """Run the claim `statement` now; own what it claimed; read their cancel flags."""
        now = utcnow()
        params.update(claim_now=now,
                      claim_lease=now + timedelta(seconds=self.settings.lease_seconds))
        # NOTE: one statement, so no transaction around it (one round trip, atomic by
        # itself), and Core rather than an ORM session
        with self._bind.connect() as conn:
            rows = list(conn.execute(statement, params).all())
        for row in rows:
            self.own(str(row.id), int(row.attempts))
        cancelled = self._cancel_requested([str(row.id) for row in rows])
        return [ClaimedRow._make((*row, str(row.id) in cancelled)) for row in rows]

    def _cancel_requested(self, job_ids: list[str]) -> set[str]:
        """Those of `job_ids` whose cancel flag is set (one round trip for all)."""
        if not job_ids:
            return set()
        try:
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.exists(cancel_flag_key(self.settings, job_id))
            flags = pipe.execute()
        except Exception:  # the cancel channel still reaches the batcher
            logger.warning("could not read the cancel flags of jobs %s", job_ids,
                           exc_info=True)
            return set()
        return {job_id for job_id, flag in zip(job_ids, flags) if flag}


def _next_queued(which: ColumnElement[bool], order: tuple[Any, ...],
                 limit: ColumnElement[int], name: str) -> CTE:
    """The first `limit` queued jobs `which` selects, in `order`, for a claim (their ids,
    locked).

    NOTE: SKIP LOCKED: groups claiming at once take different rows (Postgres; the
    conditional UPDATE alone keeps a claim single elsewhere). MATERIALIZED: as a plain
    subquery of the UPDATE, Postgres may run the SELECT more than once, and each run
    skips the rows the last one locked: a claim of 2 took 3 lines."""
    return (select(Job.id).where(which, job_status_is(JobStatus.QUEUED))
            .order_by(*order).limit(limit).with_for_update(skip_locked=True)
            .cte(name).prefix_with("MATERIALIZED"))


def _ids(locked: CTE, *where: ColumnElement[bool]) -> ColumnElement[Any]:
    """The ids `locked` selected (those of them `where` holds for), as one array (NULL
    when none).

    NOTE: the cast makes `ANY` take one array (`ANY ((SELECT ...))`), not the subquery
    form `ANY (SELECT ...)` that compares against each of its rows."""
    ids = select(func.array_agg(locked.c.id)).where(*where)
    return cast(ids.scalar_subquery(), ARRAY(Uuid))
