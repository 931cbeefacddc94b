"""What was tuned, how fast, and how close to the hardware limit: rows built from the DB.

Everything here is computed from stored trials only (no kernel is imported or run), so a
report can be made on any machine from a copied DB file.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from mla_tune.db import TrialRow, TuningStore
from mla_tune.problem.shapes import KVFormat, Shape
from mla_tune.results.winner import Winner
from mla_tune.tuning.runoff import timed_with

LIBRARY_BACKENDS = ("flashinfer", "aiter")
THIN_TRIALS = 2
"""A kernel family with at most this many timed trials at a shape, where it has more than
THIN_ELSEWHERE at another shape of the same device and KV format, was barely swept there:
its best variant for that shape may never have been timed (`thin_sweeps`)."""
THIN_ELSEWHERE = 10
ALL_FORMATS = "all"
# Two-sided 95% Student-t quantiles for 1-9 degrees of freedom; from 10 on the
# Cornish-Fisher expansion in `t95` is within 1e-5 (relative) of the exact value.
_T95_SMALL = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469, 7: 2.3646,
              8: 2.306, 9: 2.2622}


def t95(dof: int) -> float:
    """Two-sided 95% Student-t quantile: timing runs have few samples (the timer stops at a
    target error), so the normal 1.96 would understate the interval."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    if dof in _T95_SMALL:
        return _T95_SMALL[dof]
    z = statistics.NormalDist().inv_cdf(0.975)
    v = float(dof)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4))


def ci95_halfwidth(std_us: float | None, n: int | None) -> float | None:
    """Half-width of the 95% confidence interval of the mean time, from std and n."""
    if std_us is None or n is None or n < 2:
        return None
    return t95(n - 1) * std_us / math.sqrt(n)


def _knob_order(value: Any) -> tuple[int, float, str]:
    """Numbers first in numeric order, then everything else by its text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return (0, float(value), "")
        except OverflowError:  # an integer of hundreds of digits: a damaged row's
            return (0, math.copysign(math.inf, value), "")
    return (1, 0.0, json.dumps(value))


def newest_sources(trials: Iterable[TrialRow]) -> dict[str, str]:
    """Per backend, the source hash of its most recently measured trial: the sources that
    are current as far as the DB knows (the report imports no kernels to ask)."""
    latest: dict[str, tuple[int, str]] = {}
    for t in trials:
        if t.backend not in latest or t.id > latest[t.backend][0]:
            latest[t.backend] = (t.id, t.source_hash)
    return {b: h for b, (_, h) in latest.items()}


def latest_source_trials(trials: Iterable[TrialRow]) -> list[TrialRow]:
    """Per backend, only the trials of its most recently measured sources: timings of
    sources that changed since describe code that no longer exists."""
    trials = list(trials)
    newest = newest_sources(trials)
    return [t for t in trials if t.source_hash == newest[t.backend]]


def best_by_knob(trials: Iterable[TrialRow], backend: str, knob: str) -> list[tuple[Any, float]]:
    """(knob value, fastest ok time with that value) for one backend, values in order: the
    curve 'time vs this knob' with every other knob at its best."""
    best: dict[str, tuple[Any, float]] = {}
    for t in trials:
        if t.backend != backend or t.status != "ok" or t.median_us is None or knob not in t.config:
            continue
        value = t.config[knob]
        k = json.dumps(value, sort_keys=True)
        if k not in best or t.median_us < best[k][1]:
            best[k] = (value, t.median_us)
    return sorted(best.values(), key=lambda vt: _knob_order(vt[0]))


def knob_spread(trials: Iterable[TrialRow], backend: str) -> dict[str, float]:
    """How much each knob of `backend` mattered: slowest over fastest of its per-value best
    times (1.0 = no effect). Knobs seen with a single value are left out."""
    trials = list(trials)
    knobs = sorted({k for t in trials if t.backend == backend and t.status == "ok"
                    for k in t.config})
    spread = {}
    for knob in knobs:
        times = [us for _, us in best_by_knob(trials, backend, knob)]
        if len(times) >= 2:
            spread[knob] = max(times) / min(times)
    return dict(sorted(spread.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class ReportRow:
    """One tuned shape: its winner, its speed, and its baselines (the view's own fields,
    from the trials of the winner's tuning key)."""

    winner: Winner
    std_us: float | None
    n: int | None
    eff_gbps: float
    pct_of_read_bw: float | None
    baseline_backend: str | None
    baseline_us: float | None
    torch_us: float | None
    counts: dict[str, int]
    mean_us: float | None = None
    trials: tuple[TrialRow, ...] = field(default=(), repr=False, compare=False)
    superseded: bool = False
    """Its backend's kernel sources have been measured in a newer version since: the
    winner describes code that no longer runs (the dispatcher ignores it)."""

    @property
    def shape(self) -> Shape:
        return self.winner.shape

    @property
    def device(self) -> str:
        return self.winner.device.name

    @property
    def backend(self) -> str:
        return self.winner.backend

    @property
    def config(self) -> dict[str, Any]:
        return self.winner.config

    @property
    def median_us(self) -> float:
        return self.winner.median_us

    @property
    def device_hash(self) -> str:
        return self.winner.device.hash

    @property
    def software_hash(self) -> str:
        return self.winner.software.hash

    @property
    def updated_at(self) -> datetime | None:
        return self.winner.updated_at

    @property
    def trial_id(self) -> int | None:
        return self.winner.trial_id

    @property
    def moment_spread_us(self) -> float | None:
        """How far apart the winner's two timings lay, when a sweep's run-off timed it again
        (first vs side-by-side median): the device's moment-to-moment spread at this
        shape, which one timing's CI does not show."""
        win = next((t for t in self.trials if t.id == self.trial_id), None)
        if win is None or win.first_median_us is None or win.runoff_median_us is None:
            return None
        return abs(win.first_median_us - win.runoff_median_us)

    @property
    def side_by_side(self) -> int:
        """How many trials were timed in one interleaved run with the winner, it included
        (sweep --runoff); 0 when its time is its first one."""
        return timed_with(self.trials, self.trial_id)

    @property
    def speedup_vs_baseline(self) -> float | None:
        return self.baseline_us / self.median_us if self.baseline_us else None

    @property
    def speedup_vs_torch(self) -> float | None:
        return self.torch_us / self.median_us if self.torch_us else None

    @property
    def ci95_us(self) -> float | None:
        """Half-width of the 95% CI of the winner's mean time (None below 2 samples)."""
        return ci95_halfwidth(self.std_us, self.n)

    @cached_property
    def family_trials(self) -> dict[str, int]:
        """Timed (ok) trials per backend at this shape, of each backend's newest source
        here: how thoroughly each family was swept."""
        return dict(Counter(t.backend for t in latest_source_trials(self.trials)
                            if t.status == "ok"))

    @cached_property
    def knob_spread(self) -> dict[str, float]:
        """Which knobs of the winning backend mattered (see `knob_spread`); computed once
        per row (the HTML report reads it several times)."""
        return knob_spread(latest_source_trials(self.trials), self.backend)

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape.label(), "shape_key": self.shape.key, "device": self.device,
            "device_hash": self.device_hash, "software_hash": self.software_hash,
            "backend": self.backend, "config": self.config, "median_us": self.median_us,
            "mean_us": self.mean_us, "std_us": self.std_us, "n": self.n,
            "ci95_us": self.ci95_us, "eff_gbps": self.eff_gbps,
            "pct_of_read_bw": self.pct_of_read_bw, "baseline_backend": self.baseline_backend,
            "baseline_us": self.baseline_us, "speedup_vs_baseline": self.speedup_vs_baseline,
            "torch_us": self.torch_us, "speedup_vs_torch": self.speedup_vs_torch,
            "trials": self.counts, "family_trials": self.family_trials,
            "knob_spread": self.knob_spread,
            "superseded": self.superseded, "side_by_side": self.side_by_side,
            "moment_spread_us": self.moment_spread_us,
        }

    @property
    def above_ceiling(self) -> bool:
        """It read faster than the device's stored read ceiling: shown unclamped and
        flagged, since a ceiling measured too low is what such a row shows."""
        return self.pct_of_read_bw is not None and self.pct_of_read_bw > 100.0

    @property
    def winner_label(self) -> str:
        """The winning backend, marked when its sources are superseded."""
        return f"{self.backend} (superseded)" if self.superseded else self.backend


def geomean(values: Iterable[float | None]) -> float | None:
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


def _row(w: Winner, trials: list[TrialRow], superseded: bool) -> ReportRow:
    """The report row of winner `w`, from the trials of its tuning key (oldest first)."""
    shape = w.shape
    ok = [t for t in trials if t.status == "ok"]
    win = next((t for t in trials if t.id == w.trial_id), None)
    base_backend, base_us = _best(ok, LIBRARY_BACKENDS)
    _, torch_us = _best(ok, ("torch",))
    if base_backend is None and torch_us is not None:
        base_backend, base_us = "torch", torch_us
    gbps = shape.kv_bytes / (w.median_us * 1e-6) / 1e9
    bw = w.device_read_bw_gbps
    return ReportRow(
        winner=w, std_us=win.std_us if win else None, n=win.n if win else None, eff_gbps=gbps,
        pct_of_read_bw=100.0 * gbps / bw if bw else None,
        baseline_backend=base_backend, baseline_us=base_us, torch_us=torch_us,
        counts=dict(Counter(t.status for t in trials)),
        mean_us=win.mean_us if win else None, trials=tuple(trials), superseded=superseded)


def report_rows(store: TuningStore, shape_key: str | None = None, *,
                shape_keys: Collection[str] | None = None, device_hash: str | None = None,
                software_hash: str | None = None) -> list[ReportRow]:
    """Report rows for every stored winner, optionally narrowed to one shape key, a set of
    shape keys (a suite), and/or one device or software stack (hash prefixes). A winner
    row that is not a valid one (a damaged row) is left out by the store, which says why
    (`store.skipped`)."""
    winners = [w for w in store.winners(shape_key=shape_key)
               if (shape_keys is None or w.shape_key in shape_keys)
               and (device_hash is None or w.device.hash.startswith(device_hash))
               and (software_hash is None or w.software.hash.startswith(software_hash))]
    # One query for all trials, grouped by tuning key (a query per winner was slow on
    # PostgreSQL over a network).
    by_key: dict[tuple[int, int, str], list[TrialRow]] = defaultdict(list)
    trials = store.trials(shape_key=shape_key) if winners else []
    for t in trials:
        by_key[t.device_id, t.software_id, t.shape_key].append(t)
    newest = newest_sources(trials)
    rows = []
    for w in winners:
        rows.append(_row(w, by_key[w.device_id, w.software_id, w.shape_key],
                         superseded=w.source_hash != newest.get(w.backend, w.source_hash)))
    rows.sort(key=lambda r: (r.device, r.software_hash, r.shape.kv_format.value, r.shape.q_len,
                             r.shape.heads, r.shape.kv_len, r.shape.batch))
    return rows


def suite_keys(shapes: Iterable[Shape]) -> set[str]:
    """Shape keys of a suite in every KV format: a suite names problem sizes, and the
    format a user tuned them in is theirs to choose."""
    return {s.with_format(f).key for s in shapes for f in KVFormat}


@dataclass(frozen=True)
class SuiteSummary:
    """Geometric means of one device + stack over a group of shapes (one KV format, or all
    formats together), as the leaderboard ranks a suite."""

    device: str
    software_hash: str
    kv_format: str
    shapes: int
    missing: int | None
    geomean_us: float | None
    speedup_vs_baseline: float | None
    speedup_vs_torch: float | None
    superseded: int = 0
    """Winners of this group left out because their kernel sources are superseded."""
    with_baseline: int = 0
    """Shapes of `shapes` with a baseline timed: the vs-baseline geomean is over these."""
    with_torch: int = 0
    """Shapes of `shapes` with a torch time: the vs-torch geomean is over these."""

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "software_hash": self.software_hash,
                "kv_format": self.kv_format, "shapes": self.shapes, "missing": self.missing,
                "geomean_us": self.geomean_us, "speedup_vs_baseline": self.speedup_vs_baseline,
                "speedup_vs_torch": self.speedup_vs_torch, "superseded": self.superseded,
                "with_baseline": self.with_baseline, "with_torch": self.with_torch}

    def speedup_texts(self) -> list[str]:
        """'1.23x vs baseline over 3 of 14 shapes', and the same vs torch: a geomean over
        the shapes that have that time, saying how many of the group's shapes those are."""
        return [f"{v:.2f}x vs {name} over {n} of {self.shapes} shapes"
                for name, v, n in (("baseline", self.speedup_vs_baseline, self.with_baseline),
                                   ("torch", self.speedup_vs_torch, self.with_torch)) if v]


def suite_summaries(rows: Sequence[ReportRow],
                    suite: Sequence[Shape] | None = None) -> list[SuiteSummary]:
    """Geomeans per (device, stack, KV format), plus an all-formats line where a group spans
    several formats. With `suite`, `missing` counts the suite's sizes with no winner in that
    format, since a geomean over part of a suite is not comparable with a full one.
    Superseded winners are left out (counted in `superseded`): they time code that no
    longer runs."""
    sizes = {s.with_format(KVFormat.BF16).key for s in suite} if suite is not None else None
    groups: dict[tuple[str, str], list[ReportRow]] = defaultdict(list)
    for r in rows:
        groups[(r.device, r.software_hash)].append(r)
    out: list[SuiteSummary] = []
    for (device, sw), group in groups.items():
        by_format: dict[str, list[ReportRow]] = defaultdict(list)
        for r in group:
            by_format[r.shape.kv_format.value].append(r)
        if len(by_format) > 1:
            by_format[ALL_FORMATS] = group
        for fmt, all_rs in by_format.items():
            rs = [r for r in all_rs if not r.superseded]
            missing = None
            if sizes is not None:
                expected = len(sizes) * (len(by_format) - 1 if fmt == ALL_FORMATS else 1)
                missing = expected - len(rs)
            out.append(SuiteSummary(
                device=device, software_hash=sw, kv_format=fmt, shapes=len(rs),
                missing=missing, geomean_us=geomean(r.median_us for r in rs),
                speedup_vs_baseline=geomean(r.speedup_vs_baseline for r in rs),
                speedup_vs_torch=geomean(r.speedup_vs_torch for r in rs),
                superseded=len(all_rs) - len(rs),
                with_baseline=sum(1 for r in rs if r.speedup_vs_baseline),
                with_torch=sum(1 for r in rs if r.speedup_vs_torch)))
    return out


def baseline_sources(rows: Sequence[ReportRow]) -> dict[tuple[str, str], Counter[str]]:
    """Per (device, stack): how many of its current winners have a baseline from each
    backend. A baseline is always of the winner's own device and stack; a stack swept
    without a library installed has torch (or no) baselines, whatever older stacks had."""
    out: dict[tuple[str, str], Counter[str]] = {}
    for r in rows:
        if r.superseded:
            continue
        c = out.setdefault((r.device, r.software_hash), Counter())
        if r.baseline_backend and r.baseline_us:
            c[r.baseline_backend] += 1
    return out


def config_text(config: dict[str, Any]) -> str:
    """A config as `knob=value` pairs: a third of its JSON's width."""
    return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                    for k, v in sorted(config.items()))


def _pct(r: ReportRow) -> str:
    if r.pct_of_read_bw is None:
        return "-"
    return f"{r.pct_of_read_bw:.0f}%" + ("!" if r.above_ceiling else "")


def _trials_text(r: ReportRow) -> str:
    c = r.counts
    return f"{c.get('ok', 0)}/{c.get('wrong', 0)}/{c.get('failed', 0)}/{c.get('timeout', 0)}"


@dataclass(frozen=True)
class Column:
    """One column of the terminal and markdown tables."""

    header: str
    cell: Callable[[ReportRow], str]
    numeric: bool = True
    help: str = ""


COLUMNS: dict[str, Column] = {
    "device": Column("device", lambda r: r.device, False),
    "stack": Column("stack", lambda r: r.software_hash[:8], False, "software stack hash"),
    "shape": Column("shape", lambda r: r.shape.label(), False),
    "winner": Column("winner", lambda r: r.backend + ("*" if r.superseded else ""), False,
                     "* = superseded"),
    "config": Column("config", lambda r: config_text(r.config), False),
    "us": Column("µs", lambda r: f"{r.median_us:.1f}", help="median"),
    "ci": Column("±95%", lambda r: f"{r.ci95_us:.1f}" if r.ci95_us is not None else "-"),
    "sbs": Column("side", lambda r: str(r.side_by_side) if r.side_by_side else "-",
                  help="variants timed side by side with it"),
    "gbps": Column("GB/s", lambda r: f"{r.eff_gbps:.0f}"),
    "bw": Column("% bw", _pct, help="of the device's measured read ceiling"),
    "baseline": Column("baseline", lambda r: r.baseline_backend or "-", False),
    "baseline_us": Column("base µs", lambda r: f"{r.baseline_us:.1f}" if r.baseline_us
                          else "-"),
    "vs_baseline": Column("vs base", lambda r: f"{r.speedup_vs_baseline:.2f}x"
                          if r.speedup_vs_baseline else "-"),
    "vs_torch": Column("vs torch", lambda r: f"{r.speedup_vs_torch:.2f}x"
                       if r.speedup_vs_torch else "-"),
    "trials": Column("trials", _trials_text, False, "ok/wrong/failed/timeout"),
    "families": Column("timed per family", lambda r: " ".join(
        f"{b}:{n}" for b, n in sorted(r.family_trials.items())), False,
        "timed trials of each backend here"),
}
# Fits 80 columns with every shape label (`256x8192 mxfp4 h128 q4`) and backend name.
DEFAULT_COLUMNS = ("shape", "winner", "us", "ci", "gbps", "bw", "baseline", "vs_baseline")


def parse_columns(text: str) -> list[str]:
    """Column names from `a,b,c` (`default` stands for the default set); ValueError names
    the unknown ones and lists those that exist."""
    names: list[str] = []
    for part in (p.strip().lower() for p in text.split(",")):
        if part == "default":
            names.extend(DEFAULT_COLUMNS)
        elif part in COLUMNS:
            names.append(part)
        elif part:
            raise ValueError(f"unknown column {part!r}; choose from default, "
                             f"{', '.join(COLUMNS)}")
    if not names:
        raise ValueError(f"no columns given; choose from default, {', '.join(COLUMNS)}")
    return list(dict.fromkeys(names))


def markdown_table(rows: Sequence[ReportRow], columns: Sequence[str]) -> str:
    """The rows as a GitHub-flavoured markdown table (`|` in a cell escaped)."""
    cols = [COLUMNS[c] for c in columns]
    def cell(text: str) -> str:
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(c.header for c in cols) + " |",
             "|" + "|".join("---:" if c.numeric else "---" for c in cols) + "|"]
    lines += ["| " + " | ".join(cell(c.cell(r)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def shape_matcher(text: str) -> Callable[[Shape], bool]:
    """What `report --shape` selects: a shape key (`b4-q1-kv1024-h16-bf16-p1`), a label as
    the table prints it (`4x1024 bf16 h16 q1`), or the CLI notation `BATCHxKV` with any of
    a KV format, hN, qN, pN after it (`4x1024`, `4x1024 fp8`, `4x1024:fp8`). ValueError
    when the text is none of these."""
    text = text.strip()
    if _KEY_RE.fullmatch(text):
        return lambda s: s.key == text
    size = _size_text(text)
    if size is None:
        raise ValueError(f"bad shape {text!r}: give BATCHxKV (e.g. 4x1024), optionally with "
                         "a KV format, hN, qN or pN after it (e.g. '4x1024 fp8 h16'), or a "
                         "shape key from `report --format json`")
    batch, kv, ragged, parts = size

    def size(s: Shape) -> bool:  # a ragged label shows the mean kv length, `~Nr`
        return s.batch == batch and s.is_ragged == ragged and (
            s.total_kv // s.batch if ragged else s.kv_len) == kv

    tests: list[Callable[[Shape], bool]] = [size]
    for part in parts[1:]:
        q = _QUAL_RE.fullmatch(part.lower())
        if q is not None:
            attr = {"h": "heads", "q": "q_len", "p": "page_size"}[q.group(1)]
            tests.append(lambda s, a=attr, v=int(q.group(2)): getattr(s, a) == v)
            continue
        try:
            fmt = KVFormat.parse(part)
        except ValueError:
            raise ValueError(f"bad shape {text!r}: {part!r} is neither a KV format "
                             f"({', '.join(f.value for f in KVFormat)}) nor hN, qN or "
                             "pN") from None
        tests.append(lambda s, f=fmt: s.kv_format == f)
    return lambda s: all(t(s) for t in tests)


def nearest_shapes(text: str, shapes: Sequence[Shape]) -> list[Shape]:
    """The shapes closest to what `report --shape TEXT` asked for (batch and kv length on a
    log scale, then a shared KV format), for an error that names a few rather than all."""
    size = _size_text(text)
    if size is None:
        return list(shapes)
    batch, kv = max(1, size[0]), max(1, size[1])
    words = {p.lower() for p in size[3][1:]}

    def distance(s: Shape) -> tuple[float, bool]:
        mean_kv = max(1, s.total_kv // s.batch)
        return (abs(math.log2(s.batch / batch)) + abs(math.log2(mean_kv / kv)),
                s.kv_format.value not in words)

    return sorted(shapes, key=distance)


def _size_text(text: str) -> tuple[int, int, bool, list[str]] | None:
    """(batch, kv, ragged, words) of a `BATCHxKV [qualifiers...]` text (a ragged label's kv
    is its mean, `~Nr`), or None when it does not start with a size."""
    parts = [p for p in re.split(r"[\s:,/]+", text.strip()) if p]
    m = _SIZE_RE.fullmatch(parts[0]) if parts else None
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2).strip("~r")), "~" in m.group(2), parts


_KEY_RE = re.compile(r"b\d+-q\d+-kvr?\d+(-[0-9a-f]+)?-h\d+-[a-z0-9]+-p\d+")
_SIZE_RE = re.compile(r"(\d+)[xX](~?\d+r?)")
_QUAL_RE = re.compile(r"([hqp])(\d+)")


def summary_lines(rows: Sequence[Any], suite: Sequence[Shape] | None,
                   group: tuple[str, str] | None = None) -> list[str]:
    """Baselines per stack and the geomean lines of `rows` (of one device and stack when
    `group` is given), as plain text."""
    lines = []
    for (device, sw), counts in baseline_sources(rows).items():
        if group is not None and (device, sw) != group:
            continue
        current = sum(1 for r in rows if not r.superseded and (r.device, r.software_hash)
                      == (device, sw))
        have = ", ".join(f"{b} at {n}" for b, n in counts.most_common()) or "none"
        lines.append(f"baselines timed in stack {sw[:8]} on {device}: {have} of {current} "
                     "current winners (a baseline is always of the winner's own stack)")
    for s in suite_summaries(rows, suite):
        if group is not None and (s.device, s.software_hash) != group:
            continue
        where = f"{s.kv_format} on {s.device} (stack {s.software_hash[:8]})"
        if s.geomean_us is None:
            if s.superseded:
                lines.append(f"geometric mean {where}: no current winners ({s.superseded} "
                             "superseded winners left out)")
            continue
        extra = "".join(f", {t}" for t in s.speedup_texts())
        missing = f" ({s.missing} suite shapes missing)" if s.missing else ""
        stale = f" ({s.superseded} superseded winners left out)" if s.superseded else ""
        lines.append(f"geometric mean {where}: {s.geomean_us:.1f} µs over {s.shapes} shapes"
                     f"{extra}{missing}{stale}")
    return lines


def thin_sweeps(rows: Sequence[ReportRow], shown: Sequence[ReportRow] | None = None
                ) -> list[str]:
    """One line per kernel family (library baselines and torch aside: their few variants are
    all they have) with at most THIN_TRIALS timed trials at some shapes of `shown` (all
    `rows` by default) where it has more than THIN_ELSEWHERE at another shape of `rows` of
    the same device and KV format; a shape's trials counted over every stack (the
    dispatcher routes by all of them). A winner there may stand only because that family's
    better variants were never timed."""
    per_shape: dict[tuple[str, str, str], Counter[str]] = defaultdict(Counter)
    for r in rows:
        per_shape[(r.device_hash, r.shape.kv_format.value, r.shape.key)].update(
            r.family_trials)
    most: dict[tuple[str, str, str], int] = defaultdict(int)
    for (dev, fmt, _), counts in per_shape.items():
        for b, n in counts.items():
            most[(dev, fmt, b)] = max(most[(dev, fmt, b)], n)
    thin: dict[str, list[tuple[str, int]]] = defaultdict(list)
    top: dict[str, int] = defaultdict(int)
    seen: set[tuple[str, str, str]] = set()
    for r in rows if shown is None else shown:
        here = (r.device_hash, r.shape.kv_format.value, r.shape.key)
        if here in seen:
            continue
        seen.add(here)
        for (dev, fmt, b), n_most in most.items():
            if (dev, fmt) != here[:2] or n_most <= THIN_ELSEWHERE or b in LIBRARY_BACKENDS \
                    or b == "torch":
                continue
            n = per_shape[here][b]
            if n <= THIN_TRIALS:
                thin[b].append((r.shape.label(), n))
                top[b] = max(top[b], n_most)
    lines = []
    for b, found in sorted(thin.items()):
        eg = ", ".join(f"{label}: {n}" for label, n in found[:3])
        lines.append(f"thin sweeps: {b} has at most {THIN_TRIALS} timed trials at "
                     f"{len(found)} shape(s) ({eg}{', ...' if len(found) > 3 else ''}) and "
                     f"up to {top[b]} at another of the same format: its best variants there "
                     f"may never have been timed (`mla-tune sweep --shape ... --backend {b}` "
                     "times them)")
    return lines


def table_notes(rows: Sequence[Any]) -> list[str]:
    """What the table's marks mean, for the marks it shows."""
    notes = []
    if any(r.superseded for r in rows):
        notes.append("* superseded: its backend's kernel sources were measured in a newer "
                     "version since; left out of geomeans (--hide-superseded hides them)")
    high = [r for r in rows if r.above_ceiling]
    if high:
        notes.append(f"! {len(high)} winner(s) read faster than their device's stored read "
                     "ceiling, shown unclamped: that ceiling was measured too low "
                     "(bench/read_ceiling.py measures it as sweeps now do)")
    return notes


def markdown_report(rows: Sequence[Any], suite: Sequence[Shape] | None,
                     columns: Sequence[str]) -> str:
    multi = len({(r.device, r.software_hash) for r in rows}) > 1
    cols = ([c for c in ("device", "stack") if c not in columns] if multi else []) + list(columns)
    lines = [markdown_table(rows, cols), ""]
    lines += [f"- {n}" for n in table_notes(rows) + thin_sweeps(rows)
              + summary_lines(rows, suite)]
    return "\n".join(lines) + "\n"
