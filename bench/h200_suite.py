"""Tune a shape suite with the real sweep and print one table per KV format, as the
leaderboard ranks it: our best Triton variant, the best library kernel (FlashInfer), the
torch family, effective bandwidth, % of the read ceiling, and geometric means.

Run on the H200 (bench/results/triton_kernel.md has recorded runs and their exact commands):
    python3 bench/h200_suite.py --suite seeds --suite leaderboard-v1 --db tuning.db \
        [--pin triton.num_splits=0,1,4 ...] [--gpus 2]
With --report-only it sweeps nothing and prints the tables of a DB on any machine, e.g. of
the shipped H200 results:
    python3 bench/h200_suite.py --suite seeds --suite leaderboard-v1 --db shipped --report-only
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

from rich.console import Console

import benchkit
from mla_tune.backends import backend_names, get_backend, source_hashes
from mla_tune.cli.progress import SweepProgress
from mla_tune.db import TuningStore
from mla_tune.machine.bandwidth import measure_read_bandwidth
from mla_tune.machine.fingerprint import current_device, current_software
from mla_tune.problem.shapes import KVFormat, Shape
from mla_tune.problem.suites import suite_shapes
from mla_tune.reports.table import geomean
from mla_tune.tuning.space import parse_pin
from mla_tune.tuning.sweep import SweepOptions, run_sweep
from mla_tune.tuning.timing import TimingPolicy

OURS, LIBRARY, TORCH = "triton", "flashinfer", "torch"


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def tables(store: TuningStore, device_id: int, shapes: list[Shape], ceiling: float) -> str:
    """Markdown: one table per KV format over `shapes`."""
    lines: list[str] = []
    sources = source_hashes()
    for fmt in KVFormat:
        group = [s for s in shapes if s.kv_format is fmt]
        if not group:
            continue
        lines += [f"### {fmt.value} KV", "",
                  f"| shape | {OURS} µs | {LIBRARY} µs | {TORCH} µs | ours vs lib | "
                  "ours TB/s | % of read ceiling |", "|---|---|---|---|---|---|---|"]
        cols: dict[str, list[float]] = {OURS: [], LIBRARY: [], TORCH: []}
        for s in group:
            t = {b: benchkit.best_stored_us(store, device_id, s, b, sources.get(b))
                 for b in cols}
            for b, v in t.items():
                if v is not None:
                    cols[b].append(v)
            ours = t[OURS]
            tbps = s.kv_bytes / (ours * 1e-6) / 1e12 if ours else None
            ratio = t[LIBRARY] / ours if ours and t[LIBRARY] else None
            lines.append(f"| {s.label()} | {_fmt(ours)} | {_fmt(t[LIBRARY])} | {_fmt(t[TORCH])} "
                         f"| {_fmt(ratio, '.2f')}x | {_fmt(tbps, '.2f')} "
                         f"| {_fmt(tbps * 1000 / ceiling * 100 if tbps else None, '.0f')}% |")
        lines.append(f"| **geomean** | {_fmt(geomean(cols[OURS]))} | {_fmt(geomean(cols[LIBRARY]))} "
                     f"| {_fmt(geomean(cols[TORCH]))} | | | |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="append", default=[], help="suite name (repeatable)")
    ap.add_argument("--kv-format", action="append", default=[], help="restrict formats")
    ap.add_argument("--db", default="tuning.db")
    ap.add_argument("--backend", action="append", default=[], help=f"default: {OURS} {LIBRARY} {TORCH}")
    ap.add_argument("--time-budget", type=float, default=0.3, help="timing seconds per candidate")
    ap.add_argument("--budget", type=int, default=None, help="max configs per shape and backend")
    ap.add_argument("--strategy", default="grid")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--pin", action="append", default=[], help="BACKEND.KNOB=V1,V2 (as the CLI)")
    ap.add_argument("--gpus", type=int, default=1, help="worker processes, one per GPU")
    ap.add_argument("--report-only", action="store_true",
                    help="print the tables from --db without sweeping (any machine)")
    args = ap.parse_args()

    from mla_tune.tuning.search import Strategy

    formats = [KVFormat(f) for f in args.kv_format] or None
    shapes: list[Shape] = []
    for name in args.suite or ["seeds", "leaderboard-v1"]:
        shapes += [s for s in suite_shapes(name, formats) if s not in shapes]
    names = args.backend or [b for b in (OURS, LIBRARY, TORCH) if b in backend_names()]
    backends = [get_backend(n) for n in names]
    store = TuningStore(args.db, read_only=args.report_only)
    pins: dict[str, dict[str, list]] = {}
    for text in args.pin:
        backend, knob, values = parse_pin(text)
        pins.setdefault(backend, {})[knob] = values
    options = SweepOptions(devices=tuple(f"cuda:{i}" for i in range(args.gpus)),
                           strategy=Strategy(args.strategy), budget=args.budget,
                           policy=TimingPolicy(budget_s=args.time_budget), baselines=False,
                           pins=pins)
    t0 = time.time()
    if args.report_only:
        row = next(d for d in store.devices() if d.fingerprint.vendor == "nvidia")
        dev, device_id = row.fingerprint, row.id
    else:
        with SweepProgress(Console(stderr=True)) as progress:
            run_sweep(shapes, backends, store, options, progress)
        dev = current_device("cuda:0")
        device_id = store.device_id(dev)
    # The ceiling the DB stores for this device (the sweep measures it once), as the report
    # uses; measured here when the DB has none.
    ceiling = next((d.read_bw_gbps for d in store.devices() if d.id == device_id), None) \
        or measure_read_bandwidth("cuda:0") or float("nan")
    header = (f"## {dev.name}, {dt.date.today()} — {' '.join(sys.argv)}\n\n"
              f"software (of this run): "
              f"{', '.join(f'{k} {v}' for k, v in current_software().versions)}; "
              f"cold L2, median µs; read ceiling {ceiling / 1000:.2f} TB/s; "
              f"sweep wall time {time.time() - t0:.0f} s\n")
    text = header + "\n" + tables(store, device_id, shapes, ceiling)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
