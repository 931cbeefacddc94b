"""ORM models of the tuning DB.

Optuna keeps its studies in the same database under its own table names and its own
`alembic_version` table, so every table of ours starts with `mt_` and our migration
history lives in `mt_alembic_version`.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

TABLE_PREFIX = "mt_"
VERSION_TABLE = "mt_alembic_version"
TRIAL_STATUSES = ("ok", "wrong", "failed", "timeout")
CLAIM_STATES = ("pending", "running")

# Deterministic constraint names (under PostgreSQL's 63-character limit) keep the models
# and the hand-written migrations in step on SQLite and PostgreSQL.
NAMING_CONVENTION = {
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def is_ours(name: str | None, type_: str, parent_names: object) -> bool:
    """Alembic `include_name` hook: schema comparison must never touch Optuna's tables."""
    return type_ != "table" or (name or "").startswith(TABLE_PREFIX)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Device(Base):
    __tablename__ = "mt_devices"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    vendor: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(Text)
    arch: Mapped[str] = mapped_column(Text)
    sm_count: Mapped[int] = mapped_column(Integer)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    read_bw_gbps: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Software(Base):
    __tablename__ = "mt_software"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    versions_json: Mapped[str] = mapped_column(Text)


class _TuningKey:
    """The columns that say what was tuned where: device, software stack, shape, backend
    and its kernel source (`store.TrialGroup` queries by them). Shared by trials, winners
    and claims."""

    device_id: Mapped[int] = mapped_column(ForeignKey("mt_devices.id"))
    software_id: Mapped[int] = mapped_column(ForeignKey("mt_software.id"))
    shape_key: Mapped[str] = mapped_column(Text)
    backend: Mapped[str] = mapped_column(Text)
    source_hash: Mapped[str] = mapped_column(Text)


class Trial(_TuningKey, Base):
    __tablename__ = "mt_trials"
    __table_args__ = (
        UniqueConstraint("device_id", "software_id", "shape_key", "backend", "source_hash",
                         "config_key", name="uq_mt_trials_key"),
        CheckConstraint(f"status IN ({', '.join(map(repr, TRIAL_STATUSES))})", name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    shape_json: Mapped[str] = mapped_column(Text)
    kv_format: Mapped[str] = mapped_column(Text)
    config_json: Mapped[str] = mapped_column(Text)
    config_key: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    median_us: Mapped[float | None] = mapped_column(Float)
    mean_us: Mapped[float | None] = mapped_column(Float)
    std_us: Mapped[float | None] = mapped_column(Float)
    min_us: Mapped[float | None] = mapped_column(Float)
    max_us: Mapped[float | None] = mapped_column(Float)
    n: Mapped[int | None] = mapped_column(Integer)
    max_abs_err: Mapped[float | None] = mapped_column(Float)
    mismatch_frac: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    worker: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Set when a sweep timed this trial again side by side with the shape's other finalists
    # (sweep --runoff, mla_tune.tuning.runoff): the statistics above are then those of the better
    # of its timings (lower median); both medians are kept here. Trials timed together
    # share `remeasured_at`.
    first_median_us: Mapped[float | None] = mapped_column(Float)
    runoff_median_us: Mapped[float | None] = mapped_column(Float)
    remeasured_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Winner(_TuningKey, Base):
    __tablename__ = "mt_winners"
    __table_args__ = (
        UniqueConstraint("device_id", "software_id", "shape_key", name="uq_mt_winners_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    shape_json: Mapped[str] = mapped_column(Text)
    kv_format: Mapped[str] = mapped_column(Text)
    config_json: Mapped[str] = mapped_column(Text)
    trial_id: Mapped[int] = mapped_column(ForeignKey("mt_trials.id"))
    median_us: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Claim(_TuningKey, Base):
    """A candidate queued for measurement or being measured: the work queue that every
    sweep process on this DB shares. The row is deleted in the transaction that stores the
    candidate's trial, so a candidate is either queued, claimed, or measured."""

    __tablename__ = "mt_claims"
    __table_args__ = (
        UniqueConstraint("device_id", "software_id", "shape_key", "backend", "source_hash",
                         "config_key", name="uq_mt_claims_key"),
        CheckConstraint(f"state IN ({', '.join(map(repr, CLAIM_STATES))})", name="state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    config_key: Mapped[str] = mapped_column(Text)
    config_json: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    claimed_by: Mapped[str | None] = mapped_column(Text)
    # Seconds since the epoch by the database's clock, so machines with skewed clocks agree
    # on which claims went stale.
    heartbeat_at: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
