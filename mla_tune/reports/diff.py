"""What changed between two tuning runs (two DBs, or two software stacks in one DB): per
shape, the winner and its time before and after, with a regression flagged only when the
slowdown exceeds both the measured noise and a minimum relative change.

Why both: the noise of one timing (the 95% CIs of the two winners' means) is what one run
shows, but the same kernel's time also moves with the moment it is timed (on the H200
5-10 % for stretches of a second or more: bench/results/timing_protocol.md) and with
the machine (platform.md: within 2.4% above 100 us, 7% below). Where a sweep's run-off timed
a winner twice, the gap between its two timings measures the first of those and counts as
noise too; the minimum change stands for the rest.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mla_tune.db import TuningStore
from mla_tune.machine.fingerprint import SoftwareFingerprint, software_diff
from mla_tune.problem.shapes import Shape
from mla_tune.reports.table import ReportRow, geomean, report_rows
from mla_tune.results.winner import Winner

DEFAULT_MIN_CHANGE = 0.03
STATUSES = ("regression", "improvement", "same", "new", "gone")


@dataclass(frozen=True)
class DiffSide:
    """One side of a diff: the current winner per (device, shape) of a DB or of one stack."""

    label: str
    rows: tuple[ReportRow, ...]
    stacks: dict[str, SoftwareFingerprint]

    @classmethod
    def load(cls, store: TuningStore, label: str, software_hash: str | None = None) -> "DiffSide":
        """Winners of `store` (of one stack when `software_hash` is given). Where a shape was
        tuned under several stacks, the most recently updated winner stands for it."""
        latest: dict[tuple[str, str], ReportRow] = {}
        for r in report_rows(store, software_hash=software_hash):
            key = (r.device_hash, r.shape.key)
            old = latest.get(key)
            if old is None or (r.updated_at, r.software_hash) > (old.updated_at, old.software_hash):
                latest[key] = r
        used = {r.software_hash for r in latest.values()}
        stacks = {w.software.hash: w.software for w in store.winners()
                  if w.software.hash in used}
        return cls(label, tuple(latest.values()), stacks)

    def software(self) -> SoftwareFingerprint | None:
        """The one stack this side was tuned with, if it is one."""
        return next(iter(self.stacks.values())) if len(self.stacks) == 1 else None


@dataclass(frozen=True)
class DiffRow:
    """One (device, shape) before and after; `winner` names the device and shape (the
    earlier winner, or the later where the shape is new)."""

    winner: Winner
    before: ReportRow | None
    after: ReportRow | None
    noise_us: float | None
    status: str

    @property
    def device(self) -> str:
        return self.winner.device.name

    @property
    def shape(self) -> Shape:
        return self.winner.shape

    @property
    def change(self) -> float | None:
        """Relative change of the winning time (+0.10 = 10% slower)."""
        if self.before is None or self.after is None:
            return None
        return self.after.median_us / self.before.median_us - 1.0

    @property
    def winner_changed(self) -> bool:
        b, a = self.before, self.after
        return b is not None and a is not None and (b.backend, b.config) != (a.backend, a.config)

    def to_json(self) -> dict[str, Any]:
        def side(r: ReportRow | None) -> dict[str, Any] | None:
            if r is None:
                return None
            return {"backend": r.backend, "config": r.config, "median_us": r.median_us,
                    "ci95_us": r.ci95_us, "software_hash": r.software_hash}

        return {"device": self.device, "shape": self.shape.label(), "shape_key": self.shape.key,
                "before": side(self.before), "after": side(self.after),
                "change": self.change, "noise_us": self.noise_us, "status": self.status,
                "winner_changed": self.winner_changed}


def noise_us(before: ReportRow, after: ReportRow) -> float | None:
    """Measured noise of the difference: the two 95% CI half-widths combined in quadrature,
    or either winner's moment-to-moment spread (`ReportRow.moment_spread_us`) where that is
    larger; None when neither was measured (fewer than 2 samples, no run-off)."""
    a, b = before.ci95_us, after.ci95_us
    parts = [] if a is None or b is None else [math.hypot(a, b)]
    parts += [s for s in (before.moment_spread_us, after.moment_spread_us) if s is not None]
    return max(parts) if parts else None


def classify(before: ReportRow, after: ReportRow,
             min_change: float = DEFAULT_MIN_CHANGE) -> tuple[str, float | None]:
    """(status, noise): a change counts only beyond the noise and beyond `min_change` of
    the earlier time."""
    noise = noise_us(before, after)
    delta = after.median_us - before.median_us
    threshold = max(noise or 0.0, min_change * before.median_us)
    if delta > threshold:
        return "regression", noise
    if -delta > threshold:
        return "improvement", noise
    return "same", noise


def compare(before: DiffSide, after: DiffSide,
            min_change: float = DEFAULT_MIN_CHANGE) -> list[DiffRow]:
    """Every (device, shape) of either side, in report order."""
    a = {(r.device_hash, r.shape.key): r for r in before.rows}
    b = {(r.device_hash, r.shape.key): r for r in after.rows}
    out = []
    for key in dict.fromkeys([*a, *b]):
        ra, rb = a.get(key), b.get(key)
        ref = ra or b[key]
        if ra is None or rb is None:
            status, noise = ("new" if ra is None else "gone"), None
        else:
            status, noise = classify(ra, rb, min_change)
        out.append(DiffRow(ref.winner, ra, rb, noise, status))
    out.sort(key=lambda d: (d.device, d.shape.kv_format.value, d.shape.q_len, d.shape.heads,
                            d.shape.kv_len, d.shape.batch))
    return out


@dataclass(frozen=True)
class DiffSummary:
    """Geometric means over the shapes both sides tuned, per device and KV format."""

    device: str
    kv_format: str
    shapes: int
    before_us: float
    after_us: float

    @property
    def change(self) -> float:
        return self.after_us / self.before_us - 1.0

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "kv_format": self.kv_format, "shapes": self.shapes,
                "before_us": self.before_us, "after_us": self.after_us, "change": self.change}


def summarize_diff(rows: Sequence[DiffRow]) -> list[DiffSummary]:
    """Leaderboard-style geomeans before and after, over common shapes only."""
    groups: dict[tuple[str, str], list[DiffRow]] = defaultdict(list)
    for d in rows:
        if d.before is not None and d.after is not None:
            groups[(d.device, d.shape.kv_format.value)].append(d)
    out = []
    for (device, fmt), ds in groups.items():
        gb = geomean(d.before.median_us for d in ds if d.before)
        ga = geomean(d.after.median_us for d in ds if d.after)
        if gb and ga:
            out.append(DiffSummary(device, fmt, len(ds), gb, ga))
    return out


def stack_changes(before: DiffSide, after: DiffSide) -> dict[str, tuple[str | None, str | None]]:
    """Package versions that differ between the two sides, when each is one stack."""
    a, b = before.software(), after.software()
    return software_diff(a, b) if a is not None and b is not None else {}
