"""Side-by-side re-timing of each shape's finalists: when a sweep times a trial again next
to the other finalists, the trial keeps both medians and when that happened.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("mt_trials") as batch:
        batch.add_column(sa.Column("first_median_us", sa.Float(), nullable=True))
        batch.add_column(sa.Column("runoff_median_us", sa.Float(), nullable=True))
        batch.add_column(sa.Column("remeasured_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("mt_trials") as batch:
        batch.drop_column("remeasured_at")
        batch.drop_column("runoff_median_us")
        batch.drop_column("first_median_us")
