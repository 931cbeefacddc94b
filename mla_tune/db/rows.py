"""The plain records the tuning store takes and hands back.

Every one is frozen data detached from any DB session, with configs and shapes as parsed
JSON objects (a DB is data, never code), so callers never hold a connection or an ORM
object and two stores can be compared row by row.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from mla_tune.db.models import TRIAL_STATUSES
from mla_tune.machine.fingerprint import DeviceFingerprint

# The timing statistics a trial carries (those of `mla_tune.tuning.timing`), all optional.
STAT_KEYS = ("median_us", "mean_us", "std_us", "min_us", "max_us", "n")


class DBError(RuntimeError):
    """The tuning DB cannot be used as given; the message says why and what to do."""


@dataclass(frozen=True)
class TrialGroup:
    """The candidates of one backend for one tuning key (device, stack, shape, backend and
    its kernel source): what a sweep queues, claims and stores trials of."""

    device_id: int
    software_id: int
    shape_key: str
    backend: str
    source_hash: str


@dataclass(frozen=True)
class TrialResult:
    """What measuring one config of a group gave, as `record_trial` stores it: the shape it
    ran on, the config, its status, and for an 'ok' trial its timing statistics.

    Checked on construction, so a result no trial can hold never reaches the DB: `status`
    is one of TRIAL_STATUSES, `stats` has only STAT_KEYS, and an 'ok' result has a finite
    median."""

    shape_json: Mapping[str, Any]
    kv_format: str
    config: Mapping[str, Any]
    status: str
    stats: Mapping[str, float | int | None] | None = None  # made a dict; None: no timing
    max_abs_err: float | None = None
    mismatch_frac: float | None = None
    error: str | None = None
    worker: str | None = None

    def __post_init__(self) -> None:
        if self.status not in TRIAL_STATUSES:
            raise ValueError(f"status must be one of {TRIAL_STATUSES}, got {self.status!r}")
        stats = dict(self.stats or {})
        unknown = set(stats) - set(STAT_KEYS)
        if unknown:
            raise ValueError(f"unknown timing stat(s) {sorted(unknown)}; expected {STAT_KEYS}")
        median = stats.get("median_us")
        if self.status == "ok" and (median is None or not math.isfinite(median)):
            raise ValueError(f"an 'ok' trial needs a finite median_us, got {median!r}")
        object.__setattr__(self, "stats", stats)
        if isinstance(self.kv_format, enum.Enum):  # a KVFormat member: its stored name
            object.__setattr__(self, "kv_format", self.kv_format.value)


@dataclass(frozen=True)
class DeviceRow:
    """A device known to the DB, with its measured read bandwidth if any."""

    id: int
    hash: str
    fingerprint: DeviceFingerprint
    read_bw_gbps: float | None
    created_at: datetime


@dataclass(frozen=True)
class TrialRow:
    """One measured (or failed) config."""

    id: int
    device_id: int
    software_id: int
    shape_key: str
    shape_json: dict[str, Any]
    kv_format: str
    backend: str
    source_hash: str
    config: dict[str, Any]
    config_key: str
    status: str
    median_us: float | None
    mean_us: float | None
    std_us: float | None
    min_us: float | None
    max_us: float | None
    n: int | None
    max_abs_err: float | None
    mismatch_frac: float | None
    error: str | None
    worker: str | None
    created_at: datetime
    first_median_us: float | None = None
    runoff_median_us: float | None = None
    remeasured_at: datetime | None = None


@dataclass(frozen=True)
class ClaimRow:
    """A candidate queued (`pending`) or being measured (`running`) and not yet stored."""

    config: dict[str, Any]
    config_key: str
    state: str
    claimed_by: str | None
    heartbeat_age_s: float | None


@dataclass(frozen=True)
class SourceRow:
    """The trials stored for one kernel source of one backend (all devices and stacks)."""

    backend: str
    source_hash: str
    trials: int
    newest_trial_id: int
    named_by_winners: int


@dataclass(frozen=True)
class DeletedRows:
    """What `delete_sources` removed, and the trials it kept because a winner names them."""

    trials: int
    claims: int
    kept_for_winners: int


@dataclass(frozen=True)
class RenamedRows:
    """What `rename_source` moved to the new source hash, and the trials it left under the
    old one (the new hash already had a trial of the same key)."""

    trials: int
    winners: int
    claims: int
    left: int
