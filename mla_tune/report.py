"""What was tuned, how fast, and how close to the hardware limit: rows built from the DB."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mla_tune.db import TrialRow, TuningStore, WinnerRow
from mla_tune.problem import Shape

LIBRARY_BACKENDS = ("flashinfer", "aiter")


@dataclass(frozen=True)
class ReportRow:
    """One tuned shape: its winner, its speed, and its baselines."""

    shape: Shape
    device: str
    backend: str
    config: dict[str, Any]
    median_us: float
    std_us: float | None
    n: int | None
    eff_gbps: float
    pct_of_read_bw: float | None
    baseline_backend: str | None
    baseline_us: float | None
    torch_us: float | None
    counts: dict[str, int]

    @property
    def speedup_vs_baseline(self) -> float | None:
        return self.baseline_us / self.median_us if self.baseline_us else None

    @property
    def speedup_vs_torch(self) -> float | None:
        return self.torch_us / self.median_us if self.torch_us else None

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape.label(), "shape_key": self.shape.key, "device": self.device,
            "backend": self.backend, "config": self.config, "median_us": self.median_us,
            "std_us": self.std_us, "n": self.n, "eff_gbps": self.eff_gbps,
            "pct_of_read_bw": self.pct_of_read_bw, "baseline_backend": self.baseline_backend,
            "baseline_us": self.baseline_us, "speedup_vs_baseline": self.speedup_vs_baseline,
            "torch_us": self.torch_us, "speedup_vs_torch": self.speedup_vs_torch,
            "trials": self.counts,
        }


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean, as the leaderboard ranks a suite."""
    vals = [v for v in values if v and v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _best(trials: list[TrialRow], backends: Iterable[str]) -> tuple[str | None, float | None]:
    best: tuple[str | None, float | None] = (None, None)
    for b in backends:
        times = [t.median_us for t in trials if t.backend == b and t.median_us is not None]
        if times and (best[1] is None or min(times) < best[1]):
            best = (b, min(times))
    return best


def _row(store: TuningStore, w: WinnerRow) -> ReportRow:
    shape = Shape.from_json(w.shape_json)
    trials = store.trials(device_id=w.device_id, software_id=w.software_id,
                          shape_key=w.shape_key)
    ok = [t for t in trials if t.status == "ok"]
    win = next((t for t in trials if t.id == w.trial_id), None)
    base_backend, base_us = _best(ok, LIBRARY_BACKENDS)
    if base_backend is None:
        base_backend, base_us = _best(ok, ("torch",))
    _, torch_us = _best(ok, ("torch",))
    gbps = shape.kv_bytes / (w.median_us * 1e-6) / 1e9
    bw = w.device_read_bw_gbps
    return ReportRow(
        shape=shape, device=w.device.name, backend=w.backend,
        config=dict(w.config), median_us=w.median_us,
        std_us=win.std_us if win else None, n=win.n if win else None, eff_gbps=gbps,
        pct_of_read_bw=100.0 * gbps / bw if bw else None,
        baseline_backend=base_backend, baseline_us=base_us, torch_us=torch_us,
        counts=dict(Counter(t.status for t in trials)))


def report_rows(store: TuningStore, shape_key: str | None = None) -> list[ReportRow]:
    """Report rows for every stored winner (optionally one shape key)."""
    rows = [_row(store, w) for w in store.winners(shape_key=shape_key)]
    rows.sort(key=lambda r: (r.device, r.shape.kv_format.value, r.shape.q_len, r.shape.heads,
                             r.shape.kv_len, r.shape.batch))
    return rows
