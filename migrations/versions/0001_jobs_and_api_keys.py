"""jobs and api keys

Revision ID: 0001
Revises:
Create Date: 2026-11-20 21:52:08.264220
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("api_keys",
    sa.Column("id", sa.Uuid(), nullable=False),
    sa.Column("name", sa.String(length=200), nullable=False),
    sa.Column("key_hash", sa.String(length=64), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash"))
    )
    op.create_table("jobs",
    sa.Column("id", sa.Uuid(), nullable=False),
    sa.Column("api_key_id", sa.Uuid(), nullable=True),
    sa.Column("model", sa.String(length=200), nullable=False),
    sa.Column("kind", sa.String(length=16), nullable=False),
    sa.Column("prompt", sa.Text(), nullable=True),
    sa.Column("messages", sa.JSON(), nullable=True),
    sa.Column("prompt_token_ids", sa.JSON(), nullable=True),
    sa.Column("params", sa.JSON(), nullable=False),
    sa.Column("priority", sa.Integer(), nullable=False),
    sa.Column("idempotency_key", sa.String(length=200), nullable=True),
    sa.Column("status", sa.String(length=16), nullable=False),
    sa.Column("finish_reason", sa.String(length=16), nullable=True),
    sa.Column("error", sa.Text(), nullable=True),
    sa.Column("output", sa.JSON(), nullable=True),
    sa.Column("output_text", sa.Text(), nullable=True),
    sa.Column("prompt_tokens", sa.Integer(), nullable=True),
    sa.Column("completion_tokens", sa.Integer(), nullable=True),
    sa.Column("cached_tokens", sa.Integer(), nullable=True),
    sa.Column("attempts", sa.Integer(), nullable=False),
    sa.Column("worker", sa.String(length=200), nullable=True),
    sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("first_token_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"],
                            name=op.f("fk_jobs_api_key_id_api_keys")),
    sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs"))
    )
    op.create_index("ix_jobs_key_created", "jobs", ["api_key_id", "created_at"], unique=False)
    op.create_index("ix_jobs_status_lease", "jobs", ["status", "lease_expires_at"], unique=False)
    # Only rows with a key take part. NULLS NOT DISTINCT (Postgres 15+): with auth off every
    # api_key_id is NULL, and a repeated Idempotency-Key must still collide.
    op.create_index(
        "uq_jobs_key_idempotency", "jobs", ["api_key_id", "idempotency_key"], unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
        postgresql_nulls_not_distinct=True,
        sqlite_where=sa.text("idempotency_key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("uq_jobs_key_idempotency", table_name="jobs")
    op.drop_index("ix_jobs_status_lease", table_name="jobs")
    op.drop_index("ix_jobs_key_created", table_name="jobs")
    op.drop_table("jobs")
    op.drop_table("api_keys")
