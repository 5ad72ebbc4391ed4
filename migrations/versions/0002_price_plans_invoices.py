"""price plans, invoices, usage rows' invoice

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "price_plans",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("prompt_per_mtok", sa.String(length=40), nullable=False),
        sa.Column("completion_per_mtok", sa.String(length=40), nullable=False),
        sa.Column("cached_prompt_per_mtok", sa.String(length=40), nullable=False),
        sa.Column("adapter_month", sa.String(length=40), nullable=False),
        sa.Column("monthly_minimum", sa.String(length=40), nullable=False),
        sa.Column("volume_tiers", sa.JSON(), nullable=False),
        sa.Column("adapter_overrides", sa.JSON(), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_price_plans")),
        sa.UniqueConstraint("name", name=op.f("uq_price_plans_name")),
    )

    op.create_table(
        "invoices",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("period", sa.String(length=7), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("plan", sa.String(length=64), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("total", sa.String(length=40), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finalized_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_invoices_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoices")),
        sa.UniqueConstraint("tenant_id", "period", name="uq_invoices_tenant_id_period"),
    )

    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.add_column(sa.Column("invoice_id", sa.String(length=32), nullable=True))
        batch_op.create_index(
            batch_op.f("ix_usage_records_invoice_id"), ["invoice_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_records", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_usage_records_invoice_id"))
        batch_op.drop_column("invoice_id")

    op.drop_table("invoices")
    op.drop_table("price_plans")
