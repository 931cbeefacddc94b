"""How fast can anything read a shape's KV cache under the timing protocol? A dev script (run
on the GPU): a kernel that only streams the cache through TMA tiles, the way the Triton MLA
kernel loads it, and keeps a byte maximum so the loads stay live. It is timed with the
tuner's cold-L2 timer, replayed from a CUDA graph so no Python launch work is timed.

Two ways to cut the cache into programs are timed:
- `split S`: one program per (sequence, split), S splits per sequence, as the MLA kernel
  does;
- `even`: the same number of tiles for each of P programs, two or three per SM, across
  sequence boundaries.

    python3 bench/read_floor.py fp8:128x8192 fp8:64x8192 bf16:128x8192 ...

It prints one row per shape: the time of its bytes at the device's read ceiling ("ideal"),
the best of each layout (tile size, pipeline depth and split count searched), and the
committed winner (mla_tune/shipped/winners.json): the time it was stored with, and its time in this
process, on the task's inputs.
- The gap between the winner and the split-layout floor is what a kernel with this program
  layout could still win.
- The gap between the split and even floors is what rebalancing could win.

MXFP4 reads its packed values only, not its scale bytes (their 24-byte rows are not a TMA
stride), so its floor is about 6 % low.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import benchkit
from mla_tune.kernels.triton import mla_decode
from mla_tune.kernels.triton.mla_decode import KernelConfig
from mla_tune.problem.shapes import Shape
from mla_tune.tuning.timing import CudaTimer, TimingPolicy

# (element dtype, row elements, first box width): each token's row is read as two boxes,
# like the MLA kernel's nope and rope parts (a TMA box is at most 256 elements wide, and
# Triton splits wider ones).
LAYOUT = {"bf16": (torch.bfloat16, 576, 512), "fp8": (torch.uint8, 576, 512),
          "mxfp4": (torch.uint8, 288, 256)}


@triton.jit
def read_tiles(desc_a, desc_b, OUT, tiles_per_prog, total_tiles, BN: tl.constexpr,
               DA: tl.constexpr, DB: tl.constexpr, STAGES: tl.constexpr):
    """Program p streams tiles [p * tiles_per_prog, ...) of BN rows and keeps their max."""
    pid = tl.program_id(0)
    t0 = pid * tiles_per_prog
    stream_tiles(desc_a, desc_b, OUT + pid * BN, t0, tl.minimum(t0 + tiles_per_prog, total_tiles),
                 BN, DA, STAGES)


@triton.jit
def stream_tiles(desc_a, desc_b, out, t0, t1, BN: tl.constexpr, DA: tl.constexpr,
                 STAGES: tl.constexpr):
    """Tiles [t0, t1) of BN rows through both descriptors, pipelined STAGES deep; their
    per-row byte maximum goes to `out` [BN], so the loads stay live."""
    m = tl.zeros([BN], tl.float32)
    for t in tl.range(t0, t1, num_stages=STAGES):
        m = tl.maximum(m, tl.max(desc_a.load([t * BN, 0]), 1).to(tl.float32))
        m = tl.maximum(m, tl.max(desc_b.load([t * BN, DA]), 1).to(tl.float32))
    tl.store(out + tl.arange(0, BN), m)


def time_layout(cache: torch.Tensor, fmt: str, programs: int, tiles_per_prog: int,
                bn: int, stages: int, timer: CudaTimer) -> float:
    """Median µs of one read of `cache` by `programs` programs of `tiles_per_prog` tiles."""
    _, width, da = LAYOUT[fmt]
    a = TensorDescriptor.from_tensor(cache, [bn, da])
    b = TensorDescriptor(cache, cache.shape, cache.stride(), [bn, width - da])
    total = cache.shape[0] // bn
    out = torch.empty(programs * bn, dtype=torch.float32, device=cache.device)

    def run() -> None:
        read_tiles[(programs,)](a, b, out, tiles_per_prog, total, BN=bn, DA=da,
                                DB=width - da, STAGES=stages, num_warps=4,
                                num_stages=stages)

    return timer.measure(benchkit.graphed(run)).median_us


@functools.cache
def _committed() -> list[dict]:
    """The shipped winners (mla_tune/shipped/winners.json), read once."""
    return json.loads((benchkit.ROOT / "mla_tune" / "shipped" / "winners.json").read_text())["winners"]


def committed_winner(fmt: str, batch: int, kv: int) -> dict | None:
    """The committed Triton winner of the shape (heads 16, q_len 1), if there is one."""
    for w in _committed():
        s = w["shape"]
        if ((s["kv_format"], s["batch"], s["kv_lens"], s["heads"], s["q_len"]) ==
                (fmt, batch, kv, 16, 1) and w["backend"] == "triton"):
            return w
    return None


def time_winner(w: dict, shape: Shape, timer: CudaTimer) -> float:
    """Median µs of the winner's variant in this process, on the task's inputs."""
    fields = KernelConfig.__dataclass_fields__
    cfg = KernelConfig(kv_format=shape.kv_format.value,
                       **{k: v for k, v in w["config"].items() if k in fields})
    data = benchkit.task_input(shape)
    args = benchkit.launcher_args(data, shape.kv_format)
    launcher = benchkit.prepared_launcher(mla_decode, cfg, shape, data)
    return timer.measure(lambda: launcher(*args)).median_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="+", help="FORMAT:BATCHxKV, e.g. fp8:128x8192")
    ap.add_argument("--budget", type=float, default=0.3, help="timing budget per point, s")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = CudaTimer(dev, TimingPolicy(warmup=3, min_runs=20, max_runs=300,
                                        budget_s=args.budget))
    ceiling = benchkit.read_ceiling_gbps()
    print(f"read ceiling {ceiling:.0f} GB/s; µs")
    print(f"{'shape':16} {'MB':>7} {'ideal':>7} {'split floor':>26} {'even floor':>24} "
          f"{'winner: stored':>14} {'this run':>8}")
    for text in args.shapes:
        shape = benchkit.parse_format_shape(text)
        fmt, batch, kv = shape.kv_format.value, shape.batch, shape.kv_lens[0]
        dtype, width, _ = LAYOUT[fmt]
        cache = torch.ones((batch * kv, width), dtype=dtype, device=dev)
        nbytes = shape.kv_bytes
        split_best = even_best = None
        for bn in (32, 64):
            tiles = kv // bn
            for stages in (2, 3, 4):
                for splits in (1, 2, 4, 8, 16):
                    if splits > tiles:
                        continue
                    t = time_layout(cache, fmt, batch * splits, tiles // splits, bn, stages,
                                    timer)
                    if split_best is None or t < split_best[0]:
                        split_best = (t, f"S={splits} BN={bn} st={stages}")
                for per_sm in (2, 3):
                    p = per_sm * sms
                    t = time_layout(cache, fmt, p, -(-batch * tiles // p), bn, stages, timer)
                    if even_best is None or t < even_best[0]:
                        even_best = (t, f"P={p} BN={bn} st={stages}")
        del cache
        torch.cuda.empty_cache()
        ideal = nbytes / ceiling / 1e3
        w = committed_winner(fmt, batch, kv)
        stored = "-" if w is None else f"{w['median_us']:.1f}"
        now = "-" if w is None else f"{time_winner(w, shape, timer):.1f}"
        print(f"{text:16} {nbytes / 1e6:7.1f} {ideal:7.1f} "
              f"{split_best[0]:7.1f} ({split_best[1]:>17}) {even_best[0]:7.1f} "
              f"({even_best[1]:>15}) {stored:>14} {now:>8}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
