"""Leave-one-out regret of the dispatcher's fallbacks, timed on the GPU.

For every tuned uniform shape of the tuning DB(s) given (this device's winners), the
dispatcher is loaded without that shape's winner and without anything stored at that shape
(so the shape is as new to it as a user's call), and routes it. The variant it would run (its
first decision that its backend's precheck lets through) is verified and timed side by side
with the shape's winner, and with what the routing rules before the row model would have run
(the nearest tuned shape's variant as tuned, else 16-row blocks with the occupancy model's
splits), by the sweep's run-off protocol (`evaluate_side_by_side`: cold L2 before every
call, blocks of 8 calls per variant, median), in `--rounds` passes over all shapes, each
variant keeping its better time, as a run-off finalist keeps its better timing. `--hold-out family` leaves out the shape's
whole family (format, heads, q_len) instead, so what is measured is the transfer across
families, as for a family the DB has never seen.

Regret is the fallback's time over the winner's, both from this run; the ratio to the
winner's stored time is shown too (it also holds the drift between runs).

Run on the H200 (layered DBs as the dispatcher loads them):
    python3 bench/fallback_regret.py --db $OUT/coverage.db --db shipped --hold-out shape \
        --time-budget 0.05 --out $OUT/regret_shape.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import benchkit
from mla_tune.backends import get_backend
from mla_tune.machine.fingerprint import current_device
from mla_tune.problem.shapes import Shape
from mla_tune.problem.verify import tolerance_for
from mla_tune.results.winner import Winner
from mla_tune.results.winners_file import records_from_store
from mla_tune.runtime.dispatcher import Decision, Dispatcher
from mla_tune.runtime.routing_rules import closest_splits, occupancy_splits
from mla_tune.tuning.evaluate import evaluate_side_by_side
from mla_tune.tuning.space import config_key
from mla_tune.tuning.timing import CudaTimer, TimingPolicy

BARS = {"median": 1.10, "worst": 1.5}
"""The regret the fallbacks must stay within (median and worst shape)."""


def load_records(dbs: Sequence[str], device: torch.device) -> list[Winner]:
    """This device's winners of every DB in `dbs`, with where each config was verified."""
    from mla_tune.db import TuningStore, resolve_url

    here = current_device(device).hash
    out: list[Winner] = []
    for db in dbs:
        url = resolve_url(db).render_as_string(hide_password=False)
        with TuningStore(url, read_only=True) as store:
            out += [r for r in records_from_store(store, verified_for=here)
                    if r.device.hash == here]
    return out


def family(s: Shape) -> tuple[str, int, int, int]:
    return (s.kv_format.value, s.heads, s.q_len, s.page_size)


def without(records: list[Winner], out: Callable[[Shape], bool]) -> list[Winner]:
    """`records` as a DB that never saw the shapes `out` holds: their winners dropped and
    the verification facts at them removed from the others."""
    return [replace(r, verified_ok=tuple(s for s in r.verified_ok if not out(s)),
                    verified_wrong=tuple(s for s in r.verified_wrong if not out(s)))
            for r in records if not out(r.shape)]


def runs(d: Decision, device: torch.device) -> bool:
    """Whether a call would run `d` (its backend's precheck lets it through)."""
    return get_backend(d.backend).precheck(d.shape, d.config, device) is None


def previous_rule(chain: list[Decision], shape: Shape, device: torch.device,
                  units: int) -> tuple[str, dict[str, Any]] | None:
    """What the routing rules before the row model ran: the nearest tuned shape's variant
    as tuned (the last "nearest" decision of the chain: the row model's comes first), else
    the Triton family's candidates with 16-row blocks and the split count nearest
    `occupancy_splits` over 16-row blocks (the first on ties), if its precheck passes."""
    nearest = [d for d in chain if d.reason == "nearest" and runs(d, device)]
    if nearest:
        return nearest[-1].backend, dict(nearest[-1].config)
    fam = get_backend("triton")
    if not fam.available(device) or fam.supports(shape) is not None:
        return None
    cands = [c for c in fam.candidates(shape, device) if c["block_m"] == 16]
    want = occupancy_splits(shape.batch, shape.q_len * shape.heads, shape.kv_len, units)
    while cands:
        c = cands.pop(closest_splits([x["num_splits"] for x in cands], want))
        if fam.precheck(shape, c, device) is None:
            return "triton", c
    return None


def brief(config: dict[str, Any]) -> str:
    keys = ("block_m", "num_splits", "block_n", "num_stages", "kv_load", "compute",
            "fast_mode", "backend", "page_size")
    return " ".join(f"{k}={config[k]}" for k in keys if k in config)


def measure(shape: Shape, winner: Decision, fallback: Decision,
            previous: tuple[str, dict[str, Any]] | None, device: torch.device,
            timer: CudaTimer) -> dict[str, Any]:
    """Winner, fallback and the previous rule's variant, verified and timed side by side
    (a variant equal to the winner's is the winner's time: the same kernel)."""
    variants = [(winner.backend, dict(winner.config)), (fallback.backend,
                                                        dict(fallback.config))]
    if previous is not None:
        variants.append(previous)
    keys = [(b, config_key(c)) for b, c in variants]
    unique = list(dict.fromkeys(keys))
    data = benchkit.task_input(shape, device)
    ref = benchkit.reference(data, shape.kv_format)
    outcomes = evaluate_side_by_side(
        [(get_backend(b), json.loads(c)) for b, c in unique], shape, device, data, ref,
        tolerance_for(shape.kv_format), timer)
    by_key = dict(zip(unique, outcomes))

    def us(i: int) -> float | None:
        o = by_key[keys[i]]
        return o.stats.median_us if o.status == "ok" and o.stats is not None else None

    def status(i: int) -> str:
        return by_key[keys[i]].status

    return {"winner_us": us(0), "fallback_us": us(1), "fallback_status": status(1),
            "previous_us": us(2) if previous is not None else None,
            "previous_status": status(2) if previous is not None else "none",
            "same_as_winner": keys[1] == keys[0]}


def better(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two rounds' `measure` results of one shape: each variant's better time (a status
    is 'ok' if either round's was)."""
    out = dict(a)
    for us, status in (("winner_us", None), ("fallback_us", "fallback_status"),
                       ("previous_us", "previous_status")):
        got = [v for v in (a[us], b[us]) if v is not None]
        out[us] = min(got) if got else None
        if status is not None and a[status] != "ok":
            out[status] = b[status]
    return out


def _q(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summary_lines(rows: list[dict[str, Any]], key: str) -> list[str]:
    """Per family and overall: count, median, p90 and worst of `key` (a ratio column)."""
    fams: dict[str, list[float]] = {}
    for r in rows:
        if r[key] is not None:
            fams.setdefault(r["family"], []).append(r[key])
    everything = [v for vs in fams.values() for v in vs]
    out = ["| family | shapes | median | p90 | worst |", "|---|---|---|---|---|"]
    for name in sorted(fams, key=lambda f: (f.split()[0], int(f.split()[2][1:]),
                                            int(f.split()[1][1:]))):
        vs = fams[name]
        out.append(f"| {name} | {len(vs)} | {statistics.median(vs):.2f}x | "
                   f"{_q(vs, 0.9):.2f}x | {max(vs):.2f}x |")
    if everything:
        out.append(f"| **all** | {len(everything)} | {statistics.median(everything):.2f}x | "
                   f"{_q(everything, 0.9):.2f}x | {max(everything):.2f}x |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", action="append", default=[], required=True,
                    help="tuning DB (repeatable: layered as the dispatcher layers them)")
    ap.add_argument("--hold-out", choices=("shape", "family"), default="shape",
                    help="leave out the shape's winner, or its whole family's")
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8", "mxfp4"])
    ap.add_argument("--time-budget", type=float, default=0.05,
                    help="timing seconds per variant (the sweep's --time-budget)")
    ap.add_argument("--every", type=int, default=1,
                    help="measure every N-th shape only (smallest shapes first)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="passes over all shapes; each variant keeps its better time")
    ap.add_argument("--deadline", type=float, default=None,
                    help="start no shape after this many seconds (the rest is reported "
                         "as not measured)")
    ap.add_argument("--out", default=None, help="also write the markdown here (and the rows "
                                                "as JSON next to it)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: the regret is timed on the device")
    device = torch.device("cuda", 0)
    t0 = time.perf_counter()
    records = load_records(args.db, device)
    full = Dispatcher(records, device, origin=" + ".join(args.db))
    units = full.fingerprint.sm_count
    timer = CudaTimer(device, TimingPolicy(budget_s=args.time_budget, max_runs=400))
    # Every family's smallest shapes first, so a deadline leaves each family some shapes.
    shapes = sorted({r.shape for r in records if not r.shape.is_ragged
                     and r.shape.kv_format.value in args.formats},
                    key=lambda s: (s.batch, s.kv_len, family(s)))[::args.every]
    plans = []
    dispatchers: dict[Any, Dispatcher] = {}
    for shape in shapes:
        winner = full.decide(shape)
        if winner.reason != "exact":
            continue  # a record the dispatcher does not use (stale sources, other stack)
        key = shape.key if args.hold_out == "shape" else family(shape)
        if key not in dispatchers:
            out = ((lambda s, k=shape.key: s.key == k) if args.hold_out == "shape"
                   else (lambda s, f=family(shape): family(s) == f))
            dispatchers[key] = Dispatcher(without(records, out), device)
        loo = dispatchers.pop(key) if args.hold_out == "shape" else dispatchers[key]
        chain = loo.decisions(shape)
        fallback = next((d for d in chain if runs(d, device)), None)
        if fallback is not None:
            plans.append((shape, winner, fallback, previous_rule(chain, shape, device, units)))
    # Each shape is timed in every round (a pass over all shapes, so its rounds are minutes
    # apart) and each variant keeps its better time, as the sweep's run-off keeps a
    # finalist's better timing: a small shape's time can double in a slow moment of the
    # host or the device.
    times: list[dict[str, Any] | None] = [None] * len(plans)
    timed_rounds = [0] * len(plans)
    for _ in range(args.rounds):
        for i, (shape, winner, fallback, previous) in enumerate(plans):
            if args.deadline is not None and time.perf_counter() - t0 > args.deadline:
                break
            m = measure(shape, winner, fallback, previous, device, timer)
            times[i] = m if times[i] is None else better(times[i], m)
            timed_rounds[i] += 1
    rows: list[dict[str, Any]] = []
    skipped = sum(1 for m in times if m is None)
    for (shape, winner, fallback, _), m, n in zip(plans, times, timed_rounds):
        if m is None:
            continue
        row = {"shape": shape.label(), "family": f"{shape.kv_format.value} h{shape.heads} "
                                                   f"q{shape.q_len}",
               "family_key": family(shape), "batch_kv": (shape.batch, shape.kv_len),
               "reason": fallback.reason, "fallback": brief(fallback.config),
               "winner": brief(winner.config), "stored_us": winner.tuned_us, "rounds": n, **m}
        w, f, p = m["winner_us"], m["fallback_us"], m["previous_us"]
        row["regret"] = f / w if w and f else None
        row["regret_stored"] = f / winner.tuned_us if f and winner.tuned_us else None
        row["previous_regret"] = p / w if w and p else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    wall = time.perf_counter() - t0
    rows.sort(key=lambda r: (r["family_key"], r["batch_kv"]))

    ok = [r["regret"] for r in rows if r["regret"] is not None]
    failed = [r for r in rows if r["fallback_status"] != "ok"]
    lines = [f"Hold-out: {args.hold_out}; DBs: {' + '.join(args.db)}; {full.summary()}", "",
             f"{len(rows)} shapes measured in {wall:.0f} s, "
             f"{sum(r['rounds'] == args.rounds for r in rows)} of them in all {args.rounds} "
             "round(s)"
             + (f"; {skipped} not started (deadline)" if skipped else "")
             + (f"; fallback variant not ok at {len(failed)}: "
                + ", ".join(f"{r['shape']} ({r['fallback_status']})" for r in failed)
                if failed else "") + ".", ""]
    if ok:
        med, worst = statistics.median(ok), max(ok)
        lines += [f"Regret (fallback / winner, same run): median {med:.3f}x (bar "
                  f"{BARS['median']}x: {'met' if med <= BARS['median'] else 'missed'}), "
                  f"worst {worst:.3f}x (bar {BARS['worst']}x: "
                  f"{'met' if worst <= BARS['worst'] else 'missed'}); fallback is the "
                  f"winner's own variant at {sum(r['same_as_winner'] for r in rows)} "
                  "shapes.", ""]
    lines += ["### Regret per family (fallback / winner, same run)", ""]
    lines += summary_lines(rows, "regret")
    lines += ["", "### The routing rules before the row model (same shapes, same run)", ""]
    lines += summary_lines(rows, "previous_regret")
    lines += ["", "### Against the winner's stored time", ""]
    lines += summary_lines(rows, "regret_stored")
    lines += ["", "### Every shape", "",
              "| shape | route | fallback variant | winner variant | winner µs | fallback µs "
              "| regret | previous rule |", "|---|---|---|---|---|---|---|---|"]

    def cell(v: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in rows:
        lines.append(f"| {r['shape']} | {r['reason']} | {r['fallback']} | {r['winner']} | "
                     f"{cell(r['winner_us'])} | {cell(r['fallback_us'])} | "
                     f"{cell(r['regret'], '{:.2f}x')} | "
                     f"{cell(r['previous_regret'], '{:.2f}x')} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
