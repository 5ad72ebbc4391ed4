"""promotion gate: staged versions, an adapter's gate eval set, gate evals

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gate_set", sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column("gate_threshold", sa.Float(), nullable=True))
    with op.batch_alter_table("adapter_versions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("staged", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    with op.batch_alter_table("adapter_evals", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("gate", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch_op.add_column(sa.Column("gate_outcome", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("adapter_evals", schema=None) as batch_op:
        batch_op.drop_column("gate_outcome")
        batch_op.drop_column("gate")
    with op.batch_alter_table("adapter_versions", schema=None) as batch_op:
        batch_op.drop_column("staged")
    with op.batch_alter_table("adapters", schema=None) as batch_op:
        batch_op.drop_column("gate_threshold")
        batch_op.drop_column("gate_set")
