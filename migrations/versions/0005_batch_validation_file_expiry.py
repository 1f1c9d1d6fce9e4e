"""batches validated off the request (a claim and its lease), file expiry

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 01:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("files", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_files_expires", "files", ["expires_at"], unique=False)
    op.add_column("batches", sa.Column("output_expires_seconds", sa.Integer(), nullable=True))
    op.add_column("batches", sa.Column("validator", sa.String(length=64), nullable=True))
    op.add_column("batches", sa.Column("validation_lease_expires_at",
                                       sa.DateTime(timezone=True), nullable=True))
    op.add_column("batches", sa.Column("validation_attempts", sa.Integer(), nullable=False,
                                       server_default="0"))


def downgrade() -> None:
    op.drop_column("batches", "validation_attempts")
    op.drop_column("batches", "validation_lease_expires_at")
    op.drop_column("batches", "validator")
    op.drop_column("batches", "output_expires_seconds")
    op.drop_index("ix_files_expires", table_name="files")
    op.drop_column("files", "expires_at")
