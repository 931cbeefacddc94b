"""Does a variant's protocol time drift with the moment it is timed? A dev script (run on
the GPU). Times each variant in blocks of 150 protocol calls (cold L2, CUDA events), in
turn, for 24 rounds with two 5 s idle gaps, and samples nvidia-smi (SM and memory clocks,
power, throttle reasons) every 50 ms meanwhile, so slow stretches can be matched with the
device's state.

    python3 bench/timing_drift.py VARIANT [VARIANT ...] [--out DIR]

Variants use bench/kernel_probe.py's syntax. It prints one line per block (median, min,
p90 in µs) and writes the samples (`samples.jsonl`) and nvidia-smi's log (`smi.csv`) to
--out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import benchkit
from mla_tune.kernels.triton import mla_decode
from mla_tune.tuning.timing import CudaTimer, TimingPolicy

BLOCK, ROUNDS, IDLE_AFTER, IDLE_S = 150, 24, (8, 16), 5.0
SMI_FIELDS = ("timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
              "clocks_throttle_reasons.active")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("timing_drift.py times a GPU: no CUDA device here")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for text in args.variants:
        shape, cfg = benchkit.parse_variant(text)
        data = benchkit.task_input(shape)
        launcher = benchkit.prepared_launcher(mla_decode, cfg, shape, data)
        call_args = benchkit.launcher_args(data, shape.kv_format)
        runs.append((text, lambda f=launcher, a=call_args: f(*a)))
    timer = CudaTimer(torch.device("cuda"), TimingPolicy())
    for _, call in runs:
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    with open(args.out / "smi.csv", "w") as smi_log, \
            open(args.out / "samples.jsonl", "w") as samples:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}",
                                "--format=csv,noheader,nounits", "-lms", "50"],
                               stdout=smi_log)
        t0 = time.time()
        try:
            for rnd in range(ROUNDS):
                if rnd in IDLE_AFTER:
                    time.sleep(IDLE_S)
                for text, call in runs:
                    start = time.time()
                    us = [timer.sample(call) for _ in range(BLOCK)]
                    for x in us:
                        samples.write(json.dumps({"variant": text, "wall": start,
                                                  "us": x}) + "\n")
                    print(f"t={start - t0:6.1f}s {text[:40]:40} median "
                          f"{statistics.median(us):7.1f} min {min(us):7.1f} p90 "
                          f"{sorted(us)[int(0.9 * len(us))]:7.1f}", flush=True)
        finally:
            smi.terminate()


if __name__ == "__main__":
    main()
