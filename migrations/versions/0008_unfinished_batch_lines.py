"""a batch's lines still queued or running (a partial index)

Whether any line of a batch is left: asked by the writer that stored a line's result, by
a web process answering a GET of the batch, and by beat's sweep (tasks/batches.py). Only
unfinished lines are in it, so the answer is one index probe however many lines ended.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

UNFINISHED_LINES = "status IN ('queued', 'running') AND batch_id IS NOT NULL"


def upgrade() -> None:
    op.create_index("ix_jobs_unfinished_batch_lines", "jobs", ["batch_id"], unique=False,
                    postgresql_where=sa.text(UNFINISHED_LINES),
                    sqlite_where=sa.text(UNFINISHED_LINES))


def downgrade() -> None:
    op.drop_index("ix_jobs_unfinished_batch_lines", table_name="jobs")
