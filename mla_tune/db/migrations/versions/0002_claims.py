"""Claims: the shared queue of candidates, so several sweep processes (one machine or
many on one PostgreSQL) measure each candidate once and reclaim a dead process's work.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mt_claims",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("software_id", sa.Integer(), nullable=False),
        sa.Column("shape_key", sa.Text(), nullable=False),
        sa.Column("backend", sa.Text(), nullable=False),
        sa.Column("source_hash", sa.Text(), nullable=False),
        sa.Column("config_key", sa.Text(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("heartbeat_at", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("state IN ('pending', 'running')", name=op.f("ck_mt_claims_state")),
        sa.ForeignKeyConstraint(["device_id"], ["mt_devices.id"],
                                name=op.f("fk_mt_claims_device_id_mt_devices")),
        sa.ForeignKeyConstraint(["software_id"], ["mt_software.id"],
                                name=op.f("fk_mt_claims_software_id_mt_software")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_claims")),
        sa.UniqueConstraint("device_id", "software_id", "shape_key", "backend", "source_hash",
                            "config_key", name=op.f("uq_mt_claims_key")),
    )


def downgrade() -> None:
    op.drop_table("mt_claims")
