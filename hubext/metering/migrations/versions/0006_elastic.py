"""elastic slices: a record's limits (memory_limit_mib, cores_limit_percent) and its use above its
request (burst_gpu_seconds)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.add_column(sa.Column("memory_limit_mib", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("cores_limit_percent", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("burst_gpu_seconds", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.drop_column("burst_gpu_seconds")
        batch.drop_column("cores_limit_percent")
        batch.drop_column("memory_limit_mib")
