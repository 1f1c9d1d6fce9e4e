"""batch lines claimed oldest batch first, in line order (a partial index for the claim)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

QUEUED_BATCH_LINES = "status = 'queued' AND batch_id IS NOT NULL"


def upgrade() -> None:
    op.create_index("ix_jobs_queued_batch_lines", "jobs", ["model", "created_at", "batch_index"],
                    unique=False, postgresql_where=sa.text(QUEUED_BATCH_LINES),
                    sqlite_where=sa.text(QUEUED_BATCH_LINES))


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_batch_lines", table_name="jobs")
