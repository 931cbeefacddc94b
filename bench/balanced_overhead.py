"""What the balanced schedule costs against per-sequence splits on the same uniform batch.

One compiled config (the fp8/bf16 serving buckets' winners by default) over `batch`
sequences of one length, timed through the kernels the runtime has for it:
- `splits N`: per-sequence splits (SCHED_SPLITS, MlaDecodeLauncher), N splits each;
- `balanced P seg S merge`: the balanced schedule over the contiguous cache
  (SCHED_TOKENS, BalancedLauncher) with P programs, a setup charge of S blocks per
  sequence and the fused or second-launch merge.
With a length a multiple of the tile and P a multiple of the batch, the balanced runs of
`seg 0` are the same work units as `splits P/batch` (one segment per program), so their
gap is the schedule's own code; other P put two segments in most programs.
GPU time per call (CUDA events around `--calls` back-to-back calls / calls, median of 5;
the batch's KV is several times the L2, so every call reads it from HBM); every
configuration's output is checked against the float32 reference.

    python3 bench/balanced_overhead.py --format fp8 --batch 128 --lens 3995,4096 --kv-load tma
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchkit  # noqa: E402 - refuses to run against another checkout
from mla_tune.kernels.triton import mla_decode as md  # noqa: E402
from mla_tune.problem.shapes import SM_SCALE, Shape  # noqa: E402
from serving_loop import gpu_loop_us  # noqa: E402

CONFIGS = {
    "fp8": md.KernelConfig(kv_format="fp8", compute="fp8", block_m=16, block_n=64,
                           num_warps=4, num_stages=3, num_splits=1, fast_mode=True,
                           kv_load="tma"),
    "bf16": md.KernelConfig(kv_format="bf16", compute="bf16", block_m=16, block_n=32,
                            num_warps=4, num_stages=3, num_splits=1, fast_mode=True,
                            kv_load="tma"),
}


def runs(cfg: md.KernelConfig, batch: int, length: int, dev: torch.device
         ) -> list[tuple[str, Any]]:
    """(name, launcher factory) of every schedule point measured."""
    out: list[tuple[str, Any]] = []
    for n in (1, 2, 3, 4):
        c = replace(cfg, num_splits=n)

        def split(c: md.KernelConfig = c) -> Any:
            L = md.MlaDecodeLauncher(c, heads=16, q_len=1, kv_lens=[length] * batch,
                                     device=dev, sm_scale=SM_SCALE)
            L.prepare()
            return L
        out.append((f"splits {n}", split))
    for progs in sorted({batch, 2 * batch, 3 * batch, 264}):
        for seg in (0, 1, 8):
            for merge in (md.MERGE_FUSED, md.MERGE_SEPARATE):
                def bal(progs: int = progs, seg: int = seg, merge: str = merge) -> Any:
                    L = md.BalancedLauncher(cfg, heads=16, q_len=1, batch=batch, device=dev,
                                            sched=md.SCHED_TOKENS, sm_scale=SM_SCALE,
                                            programs=progs, merge=merge, seg_cost=seg)
                    L.prepare()
                    return L
                out.append((f"balanced {progs} seg {seg} {merge}", bal))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="fp8", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lens", default="3995,4096")
    ap.add_argument("--kv-load", default="tma", choices=["tma", "pointer"])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("balanced_overhead.py times GPU kernels: run it on a CUDA machine")
    dev = torch.device("cuda")
    cfg = replace(CONFIGS[args.format], kv_load=args.kv_load)
    print(f"config: {cfg}")
    print("| length | schedule | us | ok |")
    print("|---|---|---|---|")
    for length in (int(x) for x in args.lens.split(",")):
        shape = Shape(batch=args.batch, kv_lens=(length,) * args.batch, kv_format=args.format)
        data = benchkit.task_input(shape, dev)
        ref = benchkit.reference(data, args.format)
        call_args = benchkit.launcher_args(data, args.format)
        for name, make in runs(cfg, args.batch, length, dev):
            launcher = make()
            # The checked call is also the warm-up of the timed ones.
            ok = benchkit.check(launcher(*call_args), ref, args.format).ok
            us = gpu_loop_us(lambda _s, launcher=launcher: launcher(*call_args), args.calls,
                             reps=5)
            print(f"| {length} | {name} | {us:.1f} | {'ok' if ok else 'WRONG'} |", flush=True)


if __name__ == "__main__":
    main()
