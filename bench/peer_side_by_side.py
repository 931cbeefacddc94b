"""What the dispatcher runs against FlashInfer's best page size, timed side by side.

For each shape of the suites asked for and each KV format: the variant the dispatcher routes
the shape to (from the tuning DB given, as a serving process would load it) and FlashInfer's
fa3 kernel at page sizes 1 and 64 (and fa2 for fp8, whose fa3 path falls back) are built,
verified against the float32 reference, then timed interleaved in one run
(`evaluate_side_by_side`: cold L2 before every call, blocks of 8 calls), so they share the
device's fast and slow moments. FlashInfer's bf16 time is the peer figure for every format:
it is the library's fastest path.

Run on the H200 (FlashInfer from `.device`):
    python3 bench/peer_side_by_side.py --db shipped --suite seeds --suite leaderboard-v1 \
        --suite leaderboard-v2 --out $OUT/peer.md
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

import benchkit
from mla_tune.backends import get_backend
from mla_tune.problem.shapes import KVFormat, Shape
from mla_tune.problem.suites import suite_shapes
from mla_tune.problem.verify import tolerance_for
from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.tuning.evaluate import evaluate_side_by_side
from mla_tune.tuning.timing import CudaTimer, TimingPolicy

PAGES = (1, 64)


def _peer_configs(fmt: KVFormat) -> list[dict[str, Any]]:
    kernels = ("fa3",) if fmt is KVFormat.BF16 else ("fa3", "fa2")
    scale = "host" if fmt is KVFormat.BF16 else "fold"  # the one bf16 point of the space
    return [{"backend": k, "page_size": p, "launch": "direct", "fp8_scale": scale}
            for k in kernels for p in PAGES]


def _time_shape(mla: Dispatcher, shape: Shape, device: torch.device,
                timer: CudaTimer) -> dict[str, Any]:
    """The dispatcher's variant and the peer's, verified and timed side by side."""
    # What a call runs: the first variant its backend's precheck lets through.
    decision = next((d for d in mla.decisions(shape)
                     if get_backend(d.backend).precheck(shape, d.config, device) is None),
                    mla.decide(shape))
    candidates: list[tuple[Any, dict[str, Any]]] = [(get_backend(decision.backend),
                                                     dict(decision.config))]
    labels = [f"{decision.backend} [{decision.reason}]"]
    peer = get_backend("flashinfer")
    if shape.kv_format is not KVFormat.MXFP4 and peer.available(device) \
            and peer.supports(shape) is None:
        for cfg in _peer_configs(shape.kv_format):
            if peer.feasible(shape, cfg):
                candidates.append((peer, cfg))
                labels.append(f"flashinfer {cfg['backend']} page {cfg['page_size']}")
    data = benchkit.task_input(shape, device)
    ref = benchkit.reference(data, shape.kv_format)
    outcomes = evaluate_side_by_side(candidates, shape, device, data, ref,
                                     tolerance_for(shape.kv_format), timer)
    result: dict[str, Any] = {"route": labels[0], "ours": None, "peer": None, "peer_cfg": "-",
                              "notes": []}
    for label, o in zip(labels, outcomes):
        if o.status != "ok" or o.stats is None:
            result["notes"].append(f"{label}: {o.status} {(o.error or '')[:80]}")
            continue
        us = o.stats.median_us
        if label == labels[0]:
            result["ours"] = us
        elif result["peer"] is None or us < result["peer"]:
            result["peer"], result["peer_cfg"] = us, label.removeprefix("flashinfer ")
    return result


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", action="append", default=[], help="tuning DB the dispatcher "
                    "loads (repeatable: several are layered, e.g. a new sweep's over "
                    "shipped; default: the dispatcher's own default)")
    ap.add_argument("--suite", action="append", default=[], help="suite (repeatable)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8", "mxfp4"])
    ap.add_argument("--time-budget", type=float, default=0.5, help="timing seconds per variant")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU: the side-by-side run times kernels on the device")
    device = torch.device("cuda", 0)
    mla = Dispatcher.from_db(args.db or None, device)
    timer = CudaTimer(device, TimingPolicy(budget_s=args.time_budget, max_runs=400))
    formats = [KVFormat.parse(f) for f in args.formats]
    bases: list[Shape] = []
    for name in args.suite or ["seeds"]:
        for s in suite_shapes(name, [KVFormat.BF16]):
            if s not in bases:
                bases.append(s)
    lines = [f"Dispatcher: {mla.summary()}", "",
             "| shape | " + " | ".join(f"ours {f.value}" for f in formats)
             + " | FlashInfer bf16 (best page) | FlashInfer fp8 | ours best / FlashInfer bf16 "
             "| dispatcher's format / FlashInfer bf16 | routes |",
             "|---" * (len(formats) + 6) + "|"]
    ratios: list[float] = []
    chosen_ratios: list[float] = []
    best_ours: list[float] = []
    peer_bf16: list[float] = []
    notes: list[str] = []
    for base in bases:
        row: dict[KVFormat, dict[str, Any]] = {}
        for fmt in formats:
            shape = base.with_format(fmt.value)
            row[fmt] = _time_shape(mla, shape, device, timer)
            notes += [f"{shape.label()}: {n}" for n in row[fmt]["notes"]]
            print(shape.label(), row[fmt], flush=True)
        ours = [r["ours"] for r in row.values() if r["ours"] is not None]
        bf16 = row.get(KVFormat.BF16, {}).get("peer")
        fp8 = row.get(KVFormat.FP8, {}).get("peer")
        ratio = min(ours) / bf16 if ours and bf16 else None
        # The format a call holding all of them runs in (the dispatcher's own choice).
        pick = mla.choose_format(base, [f.value for f in formats])
        picked = row[pick]["ours"]
        chosen = picked / bf16 if picked and bf16 else None
        if chosen is not None:
            chosen_ratios.append(chosen)
        if ratio is not None:
            ratios.append(ratio)
            best_ours.append(min(ours))
            peer_bf16.append(bf16)
        routes = "; ".join(f"{f.value}: {r['route']}" for f, r in row.items())
        peer_cell = (f"{_f(bf16)} ({row[KVFormat.BF16]['peer_cfg']})"
                     if KVFormat.BF16 in row else "-")
        lines.append(f"| {base.batch}x{base.kv_lens[0]} h{base.heads} q{base.q_len} | "
                     + " | ".join(_f(row[f]["ours"]) for f in formats)
                     + f" | {peer_cell} | {_f(fp8)} | "
                     + ("-" if ratio is None else f"{ratio:.2f}x") + " | "
                     + ("-" if chosen is None else f"{pick.value} {chosen:.2f}x")
                     + f" | {routes} |")
    lines += ["", f"Geomean over {len(ratios)} shapes: ours (best format) "
              f"{_f(_geomean(best_ours))} µs, FlashInfer bf16 {_f(_geomean(peer_bf16))} µs, "
              f"ratio {_geomean(ratios) or float('nan'):.3f}x; shapes where ours is slower: "
              f"{sum(r > 1 for r in ratios)} of {len(ratios)}; with the format the "
              f"dispatcher picks: geomean ratio {_geomean(chosen_ratios) or float('nan'):.3f}x, "
              f"worst {max(chosen_ratios, default=float('nan')):.2f}x."]
    if notes:
        lines += ["", "Variants not timed:"] + [f"- {n}" for n in notes]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
