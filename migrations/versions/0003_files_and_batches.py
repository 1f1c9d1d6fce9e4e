"""files (chunks in the database) and batches; jobs carry their batch line

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 22:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _when(name: str) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=True)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.Uuid(), nullable=True),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("num_lines", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"],
                                name=op.f("fk_files_api_key_id_api_keys")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index("ix_files_key_created", "files", ["api_key_id", "created_at"])
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(length=64), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], ondelete="CASCADE",
                                name=op.f("fk_file_chunks_file_id_files")),
        sa.PrimaryKeyConstraint("file_id", "index", name=op.f("pk_file_chunks")),
    )
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.Uuid(), nullable=True),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("num_total", sa.Integer(), nullable=False),
        sa.Column("num_completed", sa.Integer(), nullable=False),
        sa.Column("num_failed", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        _when("in_progress_at"), _when("expires_at"), _when("finalizing_at"),
        _when("completed_at"), _when("failed_at"), _when("expired_at"),
        _when("cancelling_at"), _when("cancelled_at"),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"],
                                name=op.f("fk_batches_api_key_id_api_keys")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_index("ix_batches_key_created", "batches", ["api_key_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    # NOTE: a batch operation, so SQLite (`llmq up`) gets the foreign key by a table copy
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("batch_id", sa.String(length=64), nullable=True))
        jobs.add_column(sa.Column("custom_id", sa.String(length=512), nullable=True))
        jobs.add_column(sa.Column("batch_index", sa.Integer(), nullable=True))
        jobs.create_foreign_key(op.f("fk_jobs_batch_id_batches"), "batches", ["batch_id"],
                                ["id"])
        jobs.create_index("ix_jobs_batch", ["batch_id", "batch_index"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_index("ix_jobs_batch")
        jobs.drop_constraint(op.f("fk_jobs_batch_id_batches"), type_="foreignkey")
        jobs.drop_column("batch_index")
        jobs.drop_column("custom_id")
        jobs.drop_column("batch_id")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_key_created", table_name="batches")
    op.drop_table("batches")
    op.drop_table("file_chunks")
    op.drop_index("ix_files_key_created", table_name="files")
    op.drop_table("files")
