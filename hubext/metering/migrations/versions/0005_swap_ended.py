"""swap_ended_at: when a swapped-out kernel's swapped period ended (its resume, or its stop)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.add_column(sa.Column("swap_ended_at", sa.Double(), nullable=True))
    usage = sa.table(
        "elastic_gpu_usage",
        sa.column("id", sa.String),
        sa.column("granted_at", sa.Double),
        sa.column("resumes", sa.String),
        sa.column("swap_ended_at", sa.Double),
    )
    resume = usage.alias("resume")
    # a swapped period of the 0004 code ended when its resume was granted
    op.execute(
        usage.update()
        .where(sa.exists().where(resume.c.resumes == usage.c.id))
        .values(
            swap_ended_at=sa.select(sa.func.min(resume.c.granted_at))
            .where(resume.c.resumes == usage.c.id)
            .scalar_subquery()
        )
    )


def downgrade() -> None:
    with op.batch_alter_table("elastic_gpu_usage") as batch:
        batch.drop_column("swap_ended_at")
