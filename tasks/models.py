"""Database models (SQLAlchemy 2.0). Postgres is the source of truth for a job.

A schema change goes with an Alembic revision in `migrations/versions/`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import Enum
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    Uuid,
    literal,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql.elements import ColumnElement

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class JobStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class JobKind(str, Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class JobErrorKind(str, Enum):
    """Why a job failed. A client's own input answers 400, anything else 500."""

    INVALID_REQUEST = "invalid_request"  # the request cannot run on the served model
    SERVER_ERROR = "server_error"  # the service failed it (a step, a device, a timeout)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the key
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class BatchStatus(str, Enum):
    """OpenAI's batch statuses. `finalizing` also marks a batch whose window passed while
    its unfinished lines are being cancelled (it ends `expired`)."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED,
                        BatchStatus.CANCELLED)


class File(Base):
    """An uploaded or generated file (OpenAI's Files API); its bytes are `FileChunk`s."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # file-<hex>
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id"))
    purpose: Mapped[str] = mapped_column(String(32))  # batch, batch_output
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(Integer)
    num_lines: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # past it the file is gone (a 404 at once; beat deletes its chunks); None: kept
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_files_key_created", "api_key_id", "created_at"),
                      Index("ix_files_expires", "expires_at"))


class FileChunk(Base):
    """One piece of a file's bytes, in order (`index` from 0)."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"),
                                         primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    """An OpenAI batch: one job per line of its input file (`Job.batch_id`)."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # batch_<hex>
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))  # BatchStatus
    # NOTE: `metadata` is taken by the declarative base; the column keeps OpenAI's name
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)  # validation errors
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    num_total: Mapped[int] = mapped_column(Integer, default=0)
    num_completed: Mapped[int] = mapped_column(Integer, default=0)
    num_failed: Mapped[int] = mapped_column(Integer, default=0)
    # the model its lines all name (None: they differ) and OpenAI's `usage` of the requests
    # that ran, stored as it is finalized (before: summed from its lines at each look)
    model: Mapped[str | None] = mapped_column(String(200))
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # how long its output and error files live (None: kept until deleted)
    output_expires_seconds: Mapped[int | None] = mapped_column(Integer)
    # the web process validating it (a claim token) until its lease lapses, and how many
    # claims it has had (webapp/batch_validation.py)
    validator: Mapped[str | None] = mapped_column(String(64))
    validation_lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    validation_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    __table_args__ = (
        Index("ix_batches_key_created", "api_key_id", "created_at"),
        Index("ix_batches_status", "status"),
    )


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(16))  # JobKind
    prompt: Mapped[str | None] = mapped_column(Text)  # the rendered prompt (chat: templated)
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    prompt_token_ids: Mapped[list[int] | None] = mapped_column(JSON)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)  # SamplingParams fields
    priority: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED.value)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    # why a failed job failed, for the HTTP status of its answer: JobErrorKind
    error_kind: Mapped[str | None] = mapped_column(String(32))
    request_id: Mapped[str | None] = mapped_column(String(200))  # the client's X-Request-Id
    # per sample (n > 1): [{"index", "text", "finish_reason", "token_ids"?}]
    output: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    output_text: Mapped[str | None] = mapped_column(Text)  # sample 0, for listing and polling
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))  # device group that runs it
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    first_token_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # a line of a batch: the batch, the line's custom_id and its index in the input file
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id"))
    custom_id: Mapped[str | None] = mapped_column(String(512))
    batch_index: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        Index("ix_jobs_status_lease", "status", "lease_expires_at"),
        Index("ix_jobs_key_created", "api_key_id", "created_at"),
        Index("ix_jobs_created", "created_at"),
        Index("ix_jobs_key_status", "api_key_id", "status"),
        Index("ix_jobs_batch", "batch_id", "batch_index"),
        # the batch feeders claim a model's queued batch lines oldest batch first, in order
        Index("ix_jobs_queued_batch_lines", "model", "created_at", "batch_index",
              postgresql_where=text("status = 'queued' AND batch_id IS NOT NULL"),
              sqlite_where=text("status = 'queued' AND batch_id IS NOT NULL")),
        # a batch's lines still queued or running: whether any is left (tasks/batches.py),
        # one probe however many lines ended
        Index("ix_jobs_unfinished_batch_lines", "batch_id",
              postgresql_where=text("status IN ('queued', 'running') AND batch_id IS NOT NULL"),
              sqlite_where=text("status IN ('queued', 'running') AND batch_id IS NOT NULL")),
        # a model's queued jobs (the dashboard's counts)
        Index("ix_jobs_queued_model", "model", postgresql_where=text("status = 'queued'"),
              sqlite_where=text("status = 'queued'")),
        # a model's queued interactive jobs, none of its queued batch lines (thousands while
        # a batch runs): the claim-ahead takes them in this order, the queue limit counts them
        Index("ix_jobs_queued_interactive", "model", "priority", "created_at",
              postgresql_where=text("status = 'queued' AND batch_id IS NULL"),
              sqlite_where=text("status = 'queued' AND batch_id IS NULL")),
        # Only rows with a key take part. NULLS NOT DISTINCT (Postgres 15+): with auth off
        # every api_key_id is NULL, and a repeated Idempotency-Key must still collide.
        Index(
            "uq_jobs_key_idempotency",
            "api_key_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
            postgresql_nulls_not_distinct=True,
            sqlite_where=text("idempotency_key IS NOT NULL"),
        ),
    )


def job_status_is(*statuses: JobStatus) -> ColumnElement[bool]:
    """`jobs.status` is one of `statuses`, the values written into the SQL, not sent as
    parameters.

    For the queries the partial indexes above serve: Postgres proves an index's condition
    (`status = 'queued'`) against constants only, and a statement a connection runs five
    times is prepared (psycopg) and may then run on a generic plan, where `status = $1`
    matches no partial index. The feeder's claim of 8 lines then sorted every queued line
    of the batch: 8-11 ms a claim with 20,000 queued, 1.1-1.5 ms with the constants."""
    values = [literal(status.value, String, literal_execute=True) for status in statuses]
    return Job.status == values[0] if len(values) == 1 else Job.status.in_(values)


class StoredResponse(Base):
    """A response of the Responses API (`/v1/responses`): a chat job underneath (`job_id`)
    plus what only the response has. Its id is `resp_<job id hex>`."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id"), unique=True)
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id"))
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    instructions: Mapped[str | None] = mapped_column(Text)
    # this request's own input messages, [{"role", "content"}] (the job's messages hold the
    # whole conversation: instructions, previous turns, this input)
    input: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    background: Mapped[bool] = mapped_column(Boolean, default=False)
    store: Mapped[bool] = mapped_column(Boolean, default=True)
    max_output_tokens: Mapped[int | None] = mapped_column(Integer)
    # NOTE: `metadata` is the declarative base's own attribute; the column keeps the name
    meta: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)
