"""What the timing protocol's L2 flush costs the timed kernel. A dev script (run on the GPU).

The leaderboard flushes L2 by writing a buffer larger than it (problem.md, "Timing
protocol"), so the timed kernel starts with an L2 full of dirty lines: each line its reads
evict is first written back to DRAM, inside the timed region. The device's read ceiling
(mla_tune/machine/bandwidth.py, the figure reports compare kernels with) is measured on a 4 GiB read
without a flush, where that write-back is lost in the noise.

This script times one streaming read (mla_tune.machine.bandwidth's read-reduce kernel, replayed from
a CUDA graph) of each size under two flushes:
- `write`: the protocol's, through the tuner's own timer (mla_tune.timing.CudaTimer);
- `clean`: the same write, then a read of another buffer as large, so the kernel starts
  with an L2 of clean lines that hold none of its data.

The difference is the write-back the protocol adds. It also times an empty kernel under
both (the protocol's fixed cost), and repeats everything on freshly allocated buffers, so
the spread between allocations shows.

    python3 bench/flush_cost.py [--mb 1 4.7 ... ] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton

from benchkit import graphed
from mla_tune.machine.bandwidth import read_reduce
from mla_tune.tuning.timing import CudaTimer, TimingPolicy

# Sizes of the bars' caches (MB): 4x1024 bf16, fp8 64/128/256x8192 (= bf16 32/64/128x8192),
# bf16 256x8192, MXFP4 256x8192; and a few around the L2's size.
DEFAULT_MB = (1.0, 4.7, 16.0, 32.0, 64.0, 128.0, 302.0, 604.0, 642.0, 1208.0, 2416.0)
# read_reduce block shapes tried per size (BLOCK, ITERS, num_warps); the best one counts.
READERS = ((4096, 16, 8), (8192, 8, 8), (2048, 32, 4))


@triton.jit
def _empty_kernel(X):
    """Does nothing: the protocol's fixed cost."""


class CleanFlushTimer(CudaTimer):
    """The tuner's timer with a flush that leaves L2 holding clean lines: the protocol's
    write, then a read of a second buffer as large."""

    def __init__(self, device: torch.device, policy: TimingPolicy) -> None:
        super().__init__(device, policy)
        self._clean = torch.ones(self.flush_bytes // 4, dtype=torch.float32, device=device)
        self._sums = read_reduce(self._clean, 4096, 16, 8)

    def flush_l2(self) -> None:
        super().flush_l2()
        self._sums = read_reduce(self._clean, 4096, 16, 8)


def time_read(x: torch.Tensor, timer: CudaTimer) -> float:
    """Median µs of the best read-reduce of `x` (each reader graph-replayed)."""
    best = float("inf")
    for block, iters, warps in READERS:
        run = graphed(lambda b=block, i=iters, w=warps: read_reduce(x, b, i, w))
        best = min(best, timer.measure(run).median_us)
    return best


def time_empty(timer: CudaTimer, device: torch.device) -> float:
    """Median µs of an empty kernel."""
    x = torch.empty(1, device=device)
    return timer.measure(graphed(lambda: _empty_kernel[(1,)](x))).median_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, nargs="+", default=list(DEFAULT_MB),
                    help="read sizes in MB (1e6 bytes)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds, each on freshly allocated buffers")
    ap.add_argument("--budget", type=float, default=0.3, help="timing budget per point, s")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("flush_cost.py times a GPU: no CUDA device here")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    policy = TimingPolicy(warmup=3, min_runs=20, max_runs=300, budget_s=args.budget)
    write, clean = CudaTimer(dev, policy), CleanFlushTimer(dev, policy)
    print(f"# {props.name}, L2 {props.L2_cache_size / 2**20:.0f} MiB, flush buffer "
          f"{write.flush_bytes / 2**20:.0f} MiB; median µs per round\n")
    print("| MB | write flush (protocol) | clean flush | write-back cost | "
          "protocol GB/s | clean GB/s |")
    print("|---|---|---|---|---|---|")
    rows = [("empty kernel", None)] + [(f"{mb:g}", mb) for mb in args.mb]
    for label, mb in rows:
        w_us, c_us = [], []
        for _ in range(args.rounds):
            if mb is None:
                w_us.append(time_empty(write, dev))
                c_us.append(time_empty(clean, dev))
                continue
            n = int(mb * 1e6) // 4 // 65536 * 65536
            x = torch.ones(n, dtype=torch.float32, device=dev)
            w_us.append(time_read(x, write))
            c_us.append(time_read(x, clean))
            del x
            torch.cuda.empty_cache()
        w, c = statistics.median(w_us), statistics.median(c_us)
        rates = ("-", "-") if mb is None else (f"{mb * 1e3 / w:.0f}", f"{mb * 1e3 / c:.0f}")
        print(f"| {label} | {' / '.join(f'{t:.1f}' for t in w_us)} | "
              f"{' / '.join(f'{t:.1f}' for t in c_us)} | {w - c:.1f} | {rates[0]} | "
              f"{rates[1]} |", flush=True)


if __name__ == "__main__":
    main()
