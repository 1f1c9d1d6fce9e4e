"""responses: the Responses API's own fields of a response, over its job

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 22:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("api_key_id", sa.Uuid(), nullable=True),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("instructions", sa.Text(), nullable=True),
        sa.Column("input", sa.JSON(), nullable=False),
        sa.Column("background", sa.Boolean(), nullable=False),
        sa.Column("store", sa.Boolean(), nullable=False),
        sa.Column("max_output_tokens", sa.Integer(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"],
                                name=op.f("fk_responses_api_key_id_api_keys")),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_responses_job_id_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
        sa.UniqueConstraint("job_id", name=op.f("uq_responses_job_id")),
    )


def downgrade() -> None:
    op.drop_table("responses")
