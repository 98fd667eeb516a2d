"""resumes: the record a swapped-out kernel's new slice continues (swapped periods)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.add_column(sa.Column("resumes", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.drop_column("resumes")
