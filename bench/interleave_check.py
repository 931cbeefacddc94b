"""Does timing variants side by side change their times? A dev script (run on the GPU).
Times a few variants of one shape through the tuner's backend, each alone
(`CudaTimer.measure`) and interleaved (`CudaTimer.measure_interleaved`) with blocks of 1,
8 and 32 calls, two rounds each, so an interleaving that penalizes a variant (code evicted
from the instruction caches by the others, a slower host path) shows against its time
alone.

    python3 bench/interleave_check.py FORMAT:BATCHxKV 'CONFIG_JSON' 'CONFIG_JSON' ...
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import benchkit
import mla_tune.tuning.timing as timing
from mla_tune.backends import get_backend
from mla_tune.tuning.timing import CudaTimer, TimingPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", help="FORMAT:BATCHxKV, e.g. bf16:8x1024")
    ap.add_argument("configs", nargs="+", help="Triton family configs as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("interleave_check.py times a GPU: no CUDA device here")
    shape = benchkit.parse_format_shape(args.shape)
    dev = torch.device("cuda:0")
    data = benchkit.task_input(shape, dev)
    triton = get_backend("triton")
    calls = [lambda f=triton.build(shape, json.loads(c), dev): f(data) for c in args.configs]
    timer = CudaTimer(dev, TimingPolicy(warmup=3, min_runs=20, max_runs=500, budget_s=0.15))
    default = timing.INTERLEAVE_BLOCK
    try:
        for _ in range(2):
            alone = [timer.measure(c).median_us for c in calls]
            print(f"{args.shape} alone          ", " ".join(f"{x:7.1f}" for x in alone))
            for block in (1, 8, 32):
                timing.INTERLEAVE_BLOCK = block
                st = timer.measure_interleaved(calls)
                print(f"{args.shape} interleaved {block:2}  ",
                      " ".join(f"{s.median_us:7.1f}" for s in st), flush=True)
    finally:
        timing.INTERLEAVE_BLOCK = default


if __name__ == "__main__":
    main()
