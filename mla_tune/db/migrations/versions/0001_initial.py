"""Initial schema: devices, software stacks, trials and per-shape winners.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mt_devices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("vendor", sa.String(16), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("arch", sa.Text(), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("read_bw_gbps", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_devices")),
        sa.UniqueConstraint("hash", name=op.f("uq_mt_devices_hash")),
    )
    op.create_table(
        "mt_software",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("versions_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_software")),
        sa.UniqueConstraint("hash", name=op.f("uq_mt_software_hash")),
    )
    op.create_table(
        "mt_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("software_id", sa.Integer(), nullable=False),
        sa.Column("shape_key", sa.Text(), nullable=False),
        sa.Column("shape_json", sa.Text(), nullable=False),
        sa.Column("kv_format", sa.Text(), nullable=False),
        sa.Column("backend", sa.Text(), nullable=False),
        sa.Column("source_hash", sa.Text(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("config_key", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("median_us", sa.Float(), nullable=True),
        sa.Column("mean_us", sa.Float(), nullable=True),
        sa.Column("std_us", sa.Float(), nullable=True),
        sa.Column("min_us", sa.Float(), nullable=True),
        sa.Column("max_us", sa.Float(), nullable=True),
        sa.Column("n", sa.Integer(), nullable=True),
        sa.Column("max_abs_err", sa.Float(), nullable=True),
        sa.Column("mismatch_frac", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("status IN ('ok', 'wrong', 'failed', 'timeout')",
                           name=op.f("ck_mt_trials_status")),
        sa.ForeignKeyConstraint(["device_id"], ["mt_devices.id"],
                                name=op.f("fk_mt_trials_device_id_mt_devices")),
        sa.ForeignKeyConstraint(["software_id"], ["mt_software.id"],
                                name=op.f("fk_mt_trials_software_id_mt_software")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_trials")),
        sa.UniqueConstraint("device_id", "software_id", "shape_key", "backend", "source_hash",
                            "config_key", name=op.f("uq_mt_trials_key")),
    )
    op.create_table(
        "mt_winners",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("software_id", sa.Integer(), nullable=False),
        sa.Column("shape_key", sa.Text(), nullable=False),
        sa.Column("shape_json", sa.Text(), nullable=False),
        sa.Column("kv_format", sa.Text(), nullable=False),
        sa.Column("backend", sa.Text(), nullable=False),
        sa.Column("source_hash", sa.Text(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("median_us", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["mt_devices.id"],
                                name=op.f("fk_mt_winners_device_id_mt_devices")),
        sa.ForeignKeyConstraint(["software_id"], ["mt_software.id"],
                                name=op.f("fk_mt_winners_software_id_mt_software")),
        sa.ForeignKeyConstraint(["trial_id"], ["mt_trials.id"],
                                name=op.f("fk_mt_winners_trial_id_mt_trials")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_winners")),
        sa.UniqueConstraint("device_id", "software_id", "shape_key",
                            name=op.f("uq_mt_winners_key")),
    )


def downgrade() -> None:
    op.drop_table("mt_winners")
    op.drop_table("mt_trials")
    op.drop_table("mt_software")
    op.drop_table("mt_devices")
