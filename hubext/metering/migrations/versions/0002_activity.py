"""activity: busy seconds and memory used, from the shim or the node agent; index by user

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.add_column(sa.Column("busy_seconds", sa.Double, nullable=True))
        batch.add_column(sa.Column("activity_seconds", sa.Double, nullable=True))
        batch.add_column(sa.Column("memory_used_peak_mib", sa.Integer, nullable=True))
        batch.add_column(sa.Column("memory_used_mean_mib", sa.Double, nullable=True))
        batch.add_column(sa.Column("activity_samples", sa.Integer, nullable=False, server_default="0"))
    op.create_index("ix_elastic_gpu_usage_user", "elastic_gpu_usage", ["user"])


def downgrade() -> None:
    op.drop_index("ix_elastic_gpu_usage_user", "elastic_gpu_usage")
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        for column in (
            "activity_samples",
            "memory_used_mean_mib",
            "memory_used_peak_mib",
            "activity_seconds",
            "busy_seconds",
        ):
            batch.drop_column(column)
