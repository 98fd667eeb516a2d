"""hub groups on records; busy periods (when a slice was busy, for replays with an idle timeout)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.add_column(sa.Column("hub_groups", sa.Text, nullable=False, server_default=""))
        batch.add_column(sa.Column("busy_periods", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.drop_column("busy_periods")
        batch.drop_column("hub_groups")
