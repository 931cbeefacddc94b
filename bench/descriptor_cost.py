"""What building TMA descriptors inside the kernel costs: bench/read_floor.py's reader with one
host-made descriptor pair for the whole cache, against the same reader building its own pair
per program, bounded at its split's end, as the MLA kernel does (so a partial last tile reads
zeros, never the next sequence). A dev script, run on the GPU.

    python3 bench/descriptor_cost.py fp8:128x8192:S=2,BN=64,st=3 bf16:128x8192:S=2,BN=32,st=3

Each shape is `FORMAT:BATCHxKV:S=splits,BN=tile tokens,st=pipeline stages`. It prints two
rounds of (host, in-kernel) medians. Both readers are replayed from CUDA graphs, so this is
the GPU's cost only: a kernel taking host descriptors without a graph also pays for
encoding them on every launch.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from read_floor import LAYOUT, stream_tiles, time_layout

import benchkit
from mla_tune.tuning.timing import CudaTimer, TimingPolicy


@triton.jit
def read_tiles_own_desc(base, OUT, tiles_per_prog, W: tl.constexpr, BN: tl.constexpr,
                        DA: tl.constexpr, DB: tl.constexpr, STAGES: tl.constexpr):
    """read_floor.read_tiles, with the program's descriptors built here and ending where its
    tiles end (the same stream_tiles loop)."""
    pid = tl.program_id(0)
    t0 = pid * tiles_per_prog
    end = ((pid + 1) * tiles_per_prog * BN).to(tl.int32)
    desc_a = tl.make_tensor_descriptor(base, [end, W], [W, 1], [BN, DA])
    desc_b = tl.make_tensor_descriptor(base, [end, W], [W, 1], [BN, DB])
    stream_tiles(desc_a, desc_b, OUT + pid * BN, t0, t0 + tiles_per_prog, BN, DA, STAGES)


class _Scratch:
    """Triton's allocator for the in-kernel descriptors' global scratch (grown once)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def __call__(self, size: int, alignment: int, stream: int | None) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < size:
            self.buf = torch.empty(size, dtype=torch.int8, device="cuda")
        return self.buf


def parse(text: str) -> tuple[str, int, int, int, int, int]:
    """'fmt:BxKV:S=..,BN=..,st=..' -> (fmt, batch, kv, splits, block tokens, stages)."""
    fmt, shape, knobs = text.split(":")
    batch, kv = (int(x) for x in shape.lower().split("x"))
    kw = dict(item.split("=") for item in knobs.split(","))
    return fmt, batch, kv, int(kw["S"]), int(kw["BN"]), int(kw["st"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="+")
    args = ap.parse_args()
    triton.set_allocator(_Scratch())
    dev = torch.device("cuda")
    timer = CudaTimer(dev, TimingPolicy(warmup=3, min_runs=30, max_runs=400, budget_s=0.4))
    for text in args.shapes:
        fmt, batch, kv, splits, bn, stages = parse(text)
        dtype, width, da = LAYOUT[fmt]
        cache = torch.ones((batch * kv, width), dtype=dtype, device=dev)
        programs, tiles_per_prog = batch * splits, kv // bn // splits
        out = torch.empty(programs * bn, dtype=torch.float32, device=dev)

        def own() -> None:
            read_tiles_own_desc[(programs,)](cache, out, tiles_per_prog, W=width, BN=bn, DA=da,
                                             DB=width - da, STAGES=stages, num_warps=4,
                                             num_stages=stages)

        own_graph = benchkit.graphed(own)
        rounds = []
        for _ in range(2):
            host = time_layout(cache, fmt, programs, tiles_per_prog, bn, stages, timer)
            rounds.append(f"{host:.1f} / {timer.measure(own_graph).median_us:.1f}")
        print(f"{text:36} host / in-kernel descriptors: {', '.join(rounds)}", flush=True)


if __name__ == "__main__":
    main()
