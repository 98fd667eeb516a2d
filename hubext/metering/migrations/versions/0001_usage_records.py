"""usage records: who held which slice, when, and why it was released

Revision ID: 0001
Revises:
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "elastic_gpu_usage",
        sa.Column("id", sa.String(255), primary_key=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("namespace", sa.String(255), nullable=False),
        sa.Column("workspace", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("priority_class", sa.String(255), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("gpu_uuids", sa.Text, nullable=False),
        sa.Column("gpu_model", sa.String(255), nullable=False),
        sa.Column("gpu_memory_mib", sa.Integer, nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("memory_mib", sa.Integer, nullable=False),
        sa.Column("cores_percent", sa.Integer, nullable=False),
        sa.Column("whole", sa.Boolean, nullable=False),
        sa.Column("borrowed", sa.Boolean, nullable=False),
        sa.Column("granted_at", sa.Double, nullable=False),
        sa.Column("released_at", sa.Double, nullable=True),
        sa.Column("release_cause", sa.String(32), nullable=True),
        sa.Column("release_why", sa.Text, nullable=True),
        sa.Column("last_seen", sa.Double, nullable=False),
    )
    op.create_index("ix_elastic_gpu_usage_granted_at", "elastic_gpu_usage", ["granted_at"])
    op.create_index("ix_elastic_gpu_usage_released_at", "elastic_gpu_usage", ["released_at"])


def downgrade() -> None:
    op.drop_table("elastic_gpu_usage")
