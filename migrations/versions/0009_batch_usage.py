"""a finished batch's model and usage, stored as it is finalized

A look at a batch (`GET /v1/batches/{id}`, each batch of a list) summed its lines' tokens
every time, 26 ms of Postgres at 50,000 lines, also once the batch had ended. Now the
finalizer stores the figures; a batch finished before this revision (NULL) is still
summed from its lines.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("model", sa.String(200), nullable=True))
        batch.add_column(sa.Column("usage", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("usage")
        batch.drop_column("model")
