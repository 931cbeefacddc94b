"""Multi-GPU sweep scaling: the same sweep with `--gpus 2` and `--gpus 1`, each on a fresh
tuning DB and fresh compile caches; prints both wall times and the speedup (the target on the two-GPU H200 machine: >= 1.8x on
leaderboard-v1, bf16 KV).

On the device machine, from the repository root (see ../shared/docs/platform.md):

    source .device/setup.sh
    python3 bench/multi_gpu_sweep.py --backend triton            # ~3 min: 648 candidates
    python3 bench/multi_gpu_sweep.py --backend torch --time-budget 0.1 -- --budget 8

Arguments after `--` go to both sweeps unchanged (e.g. `--pin ...` to narrow the space,
`--no-compile-ahead` to see what the compile stage saves). Besides wall times it prints
each run's timeline from the stored trials: seconds to the first stored trial (start-up:
process, workers, compile stage, first input), the span of the trials, and the exit. The device's read bandwidth is measured
once, before either timed run, and stored in both DBs, so neither sweep spends time on it.
`--gpus 2` runs first: a library cache it warms (FlashInfer's JIT) can only favour
`--gpus 1`, so the ratio is not flattered.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from benchkit import ROOT
from mla_tune.db import TuningStore
from mla_tune.reports.table import geomean

TARGET = 1.8
_SEED_BANDWIDTH = """
import sys
from mla_tune.machine.bandwidth import measure_read_bandwidth
from mla_tune.db import TuningStore
from mla_tune.machine.fingerprint import current_device
gbps = measure_read_bandwidth("cuda:0")
print(f"read bandwidth {gbps:.0f} GB/s" if gbps else "read bandwidth: not measured")
for db in sys.argv[1:]:
    with TuningStore(db) as store:
        if gbps:
            store.set_read_bandwidth(store.device_id(current_device("cuda:0")), gbps)
"""


def _sweep(gpus: int, args: argparse.Namespace, work: Path) -> tuple[float, datetime]:
    """Run one sweep; returns its wall time in seconds (process start to exit) and when it
    started."""
    db = work / f"gpus{gpus}.db"
    cmd = [sys.executable, "-m", "mla_tune", "sweep", "--suite", args.suite,
           "--kv-format", args.kv_format, "--backend", args.backend, "--no-baseline",
           "--device", "cuda", "--gpus", str(gpus), "--db", str(db)]
    if args.time_budget is not None:
        cmd += ["--time-budget", str(args.time_budget)]
    cmd += args.extra
    # Cold compile caches for each run (Triton's and the static-check reports).
    env = dict(os.environ, TRITON_CACHE_DIR=str(work / f"triton-cache-{gpus}"),
               MLA_TUNE_CACHE=str(work / f"mla-tune-cache-{gpus}"))
    log = work / f"gpus{gpus}.log"
    print(f"--gpus {gpus}: {' '.join(cmd[1:])}", flush=True)
    started = datetime.now(timezone.utc)
    start = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        sys.exit(f"--gpus {gpus} failed with exit code {rc}; last output:\n"
                 + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    return wall, started


def _timeline(db: Path, started: datetime, wall: float) -> str:
    """Start-up, trial span and wind-down of one run, from its trials' timestamps."""
    with TuningStore(str(db)) as store:
        stamps = sorted(t.created_at for t in store.trials())
    if not stamps:
        return "no trials"
    def since(t: datetime) -> float:
        t = t if t.tzinfo else t.replace(tzinfo=timezone.utc)
        return (t - started).total_seconds()
    first, last = since(stamps[0]), since(stamps[-1])
    rate = (len(stamps) - 1) / (last - first) if last > first else float("nan")
    return (f"first trial stored at {first:.1f} s, last at {last:.1f} s "
            f"({rate:.2f} trials/s between), exit at {wall:.1f} s")


def _summary(db: Path) -> str:
    with TuningStore(str(db)) as store:
        trials = store.trials()
        winners = store.winners()
    status = Counter(t.status for t in trials)
    per_gpu = Counter(t.worker for t in trials)
    geo = geomean(w.median_us for w in winners) or float("nan")
    return (f"{len(trials)} trials ({', '.join(f'{k} {v}' for k, v in sorted(status.items()))}); "
            f"per GPU: {', '.join(f'{k} {v}' for k, v in sorted(per_gpu.items()))}; "
            f"{len(winners)} winners, geomean {geo:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--suite", default="leaderboard-v1")
    parser.add_argument("--kv-format", default="bf16")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds of timing per candidate (default: the CLI's, 1.0)")
    parser.add_argument("--out", type=Path, help="directory for the DBs and logs "
                        "(default: a new temporary one)")
    parser.add_argument("extra", nargs="*", help="more sweep options, after --")
    args = parser.parse_args()

    work = args.out or Path(tempfile.mkdtemp(prefix="mla-tune-multigpu-"))
    work.mkdir(parents=True, exist_ok=True)
    dbs = [str(work / f"gpus{n}.db") for n in (2, 1)]
    subprocess.run([sys.executable, "-c", _SEED_BANDWIDTH, *dbs], cwd=ROOT, check=True)
    runs = {n: _sweep(n, args, work) for n in (2, 1)}
    walls = {n: runs[n][0] for n in runs}
    ratio = walls[1] / walls[2]
    print(f"\n{args.suite} {args.kv_format}, backend {args.backend}, "
          f"--time-budget {args.time_budget or 'default (1.0)'} {' '.join(args.extra)}")
    for n in (1, 2):
        db = work / f"gpus{n}.db"
        print(f"  --gpus {n}: {walls[n]:7.1f} s   {_summary(db)}")
        print(f"             {_timeline(db, runs[n][1], walls[n])}")
        compiled = [ln.strip() for ln in (work / f"gpus{n}.log").read_text(
            errors="replace").splitlines() if ln.strip().startswith("compiled ")]
        if compiled:
            print(f"             {compiled[0]}")
    verdict = "meets" if ratio >= TARGET else "is below"
    print(f"  speedup --gpus 2 vs 1: {ratio:.2f}x ({verdict} the {TARGET}x target)")
    print(f"  DBs and logs: {work}")


if __name__ == "__main__":
    main()
