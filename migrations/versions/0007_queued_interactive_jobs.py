"""queued interactive jobs of a model, without its batch lines (a partial index)

The claim-ahead of an interactive job's claim and the web's queue limit select these.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

QUEUED_INTERACTIVE = "status = 'queued' AND batch_id IS NULL"


def upgrade() -> None:
    op.create_index("ix_jobs_queued_interactive", "jobs", ["model", "priority", "created_at"],
                    unique=False, postgresql_where=sa.text(QUEUED_INTERACTIVE),
                    sqlite_where=sa.text(QUEUED_INTERACTIVE))


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_interactive", table_name="jobs")
