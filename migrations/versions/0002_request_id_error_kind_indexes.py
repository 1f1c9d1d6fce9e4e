"""request id, failure kind, and the listing and queue-limit indexes

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 22:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

QUEUED = sa.text("status = 'queued'")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("request_id", sa.String(length=200), nullable=True))
    op.add_column("jobs", sa.Column("error_kind", sa.String(length=32), nullable=True))
    op.create_index("ix_jobs_created", "jobs", ["created_at"], unique=False)
    op.create_index("ix_jobs_key_status", "jobs", ["api_key_id", "status"], unique=False)
    op.create_index("ix_jobs_queued_model", "jobs", ["model"], unique=False,
                    postgresql_where=QUEUED, sqlite_where=QUEUED)


def downgrade() -> None:
    op.drop_index("ix_jobs_queued_model", table_name="jobs")
    op.drop_index("ix_jobs_key_status", table_name="jobs")
    op.drop_index("ix_jobs_created", table_name="jobs")
    op.drop_column("jobs", "error_kind")
    op.drop_column("jobs", "request_id")
