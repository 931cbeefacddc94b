"""What the tuner's timer sees with and without other kernels between two timed calls
(the L2 flushed right before each call either way):

- `nothing`: back to back (`CudaTimer`, `between_calls="nothing"`);
- `other-kernels`: the tuner's default (`OtherKernels`: a random draw, a small matrix
  product and a check before each flush, as the leaderboard's harness draws and checks
  inputs between its timed calls).

Per shape: the variant the DB routes it to and, where its splits merge in a second launch,
the same variant with the other merge launch (PDL or plain) and with the merge fused (fast
mode). The harness itself (bench/gpumode_harness.sh) is the ground truth these are checked
against. Run on the GPU:

    python3 bench/between_calls.py --db shipped --suite seeds --formats bf16 fp8 --out $OUT/between.md
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import benchkit
from mla_tune.backends import get_backend
from mla_tune.problem.shapes import KVFormat
from mla_tune.problem.suites import suite_shapes
from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.tuning.timing import NOTHING, OTHER_KERNELS, CudaTimer, TimingPolicy


def _variants(config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [("routed", dict(config))]
    if not config.get("fast_mode") and int(config.get("num_splits", 0)) != 1:
        pdl = bool(config.get("pdl", True))
        out.append(("plain merge" if pdl else "PDL merge", dict(config, pdl=not pdl)))
        out.append(("fused merge", dict(config, fast_mode=True, pdl=True)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="seeds")
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--db", default=None, help="tuning DB the routes come from (default: shipped)")
    ap.add_argument("--time-budget", type=float, default=0.3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    mla = Dispatcher.from_db(args.db, dev)
    timers = {name: CudaTimer(dev, TimingPolicy(budget_s=args.time_budget, max_runs=300,
                                                between_calls=name))
              for name in (NOTHING, OTHER_KERNELS)}
    triton = get_backend("triton")
    lines = ["| shape | variant | config | nothing | other-kernels | other-kernels / nothing |",
             "|---|---|---|---|---|---|"]
    for fmt in map(KVFormat.parse, args.formats):
        for shape in suite_shapes(args.suite, [fmt]):
            dec = mla.decide(shape)
            if dec.backend != "triton":
                continue
            data = benchkit.task_input(shape, dev)
            ref = benchkit.reference(data, fmt)
            for label, cfg in _variants(dict(dec.config)):
                if not triton.feasible(shape, cfg):
                    continue
                fn = triton.build(shape, cfg, dev)
                if not benchkit.check(fn(data), ref, fmt).ok:
                    print(shape.label(), label, "WRONG", flush=True)
                    continue
                call = lambda fn=fn: fn(data)  # noqa: E731
                t = {n: timers[n].measure(call).median_us for n in timers}
                text = ", ".join(f"{k} {v}" for k, v in sorted(cfg.items()))
                row = (f"| {shape.label()} | {label} | {text} | {t[NOTHING]:.2f} | "
                       f"{t[OTHER_KERNELS]:.2f} | {t[OTHER_KERNELS] / t[NOTHING]:.3f} |")
                print(row, flush=True)
                lines.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
