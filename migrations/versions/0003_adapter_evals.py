"""adapter evals

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapter_evals",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("adapter_id", sa.String(length=32), nullable=False),
        sa.Column("version_id", sa.String(length=32), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("previous_version", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("set_sha256", sa.String(length=64), nullable=False),
        sa.Column("num_items", sa.Integer(), nullable=False),
        sa.Column("done_items", sa.Integer(), nullable=False),
        sa.Column("scores", sa.JSON(), nullable=False),
        sa.Column("error", sa.String(length=1024), nullable=True),
        sa.Column("created_by", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_adapter_evals_adapter_id_adapters")
        ),
        sa.ForeignKeyConstraint(
            ["version_id"], ["adapter_versions.id"],
            name=op.f("fk_adapter_evals_version_id_adapter_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_evals")),
    )
    with op.batch_alter_table("adapter_evals", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_adapter_evals_adapter_id"), ["adapter_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_adapter_evals_version_id"), ["version_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("adapter_evals", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_adapter_evals_version_id"))
        batch_op.drop_index(batch_op.f("ix_adapter_evals_adapter_id"))
    op.drop_table("adapter_evals")
