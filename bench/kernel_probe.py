"""Time (or hand to a profiler) a few chosen Triton MLA decode variants side by side on a GPU:
a dev script for kernel work, not a test and not the tuner.

Each variant is `FORMAT:BATCHxKV:key=value,...` with KernelConfig's fields as keys, e.g.
`fp8:256x8192:compute=fp16,block_n=32,num_stages=3,num_splits=1,fast_mode=1`. Every variant
runs on the task's inputs and is judged by the sweep's gate against the float32 reference
before it is timed (cold L2, the tuner's timer); each line gives its median, minimum,
effective TB/s and the share of the device's read ceiling (the one the shipped DB stores
for it, else measured).

    python3 bench/kernel_probe.py VARIANT [VARIANT ...]            # time each
    ncu --kernel-name mla_decode_kernel python3 bench/kernel_probe.py --once VARIANT ...

`--once` launches each variant exactly once after its check (the check's own launch is the
one a profiler filtered on the split kernel sees first, so profile with --launch-skip 0 and
--launch-count 2 per variant, or read the second of each pair).

`--baseline FILE` times every variant a second time with the kernel source in FILE, right
after the checkout's, so an edit is compared with what it replaces in one run:

    git show HEAD:kernels/triton/mla_decode.py > bench/_base.py
    python3 bench/kernel_probe.py --baseline bench/_base.py VARIANT ...
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import torch

import benchkit
from mla_tune.kernels.triton import mla_decode
from mla_tune.tuning.timing import CudaTimer, TimingPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--once", action="store_true", help="launch once after the check")
    ap.add_argument("--budget", type=float, default=0.5, help="timing budget per variant, s")
    ap.add_argument("--baseline", type=Path,
                    help="also time each variant with the kernel source in this file")
    a = ap.parse_args()
    kernels: list[tuple[str, ModuleType]] = [("", mla_decode)]
    if a.baseline:
        kernels.append((" [baseline]", benchkit.load_kernel(a.baseline)))
    timer = None if a.once else CudaTimer(torch.device("cuda"), TimingPolicy(
        warmup=3, min_runs=20, max_runs=300, budget_s=a.budget))
    ceiling = None if a.once else benchkit.read_ceiling_gbps()
    cache: dict[str, tuple] = {}
    for text in a.variants:
        shape, cfg = benchkit.parse_variant(text, a.heads)
        if shape.key not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            data = benchkit.task_input(shape)
            cache[shape.key] = (benchkit.launcher_args(data, shape.kv_format), data,
                                benchkit.reference(data, shape.kv_format))
        args, data, ref = cache[shape.key]
        for tag, md in kernels:
            launcher = benchkit.prepared_launcher(md, cfg, shape, data)
            res = benchkit.check(launcher(*args), ref, shape.kv_format)
            line = (f"{text + tag:90} {'ok' if res.ok else 'WRONG'} err {res.max_abs_err:.3g} "
                    f"mism {res.mismatch_frac:.2%}")
            if a.once:
                launcher(*args)
                torch.cuda.synchronize()
            else:
                st = timer.measure(lambda: launcher(*args))
                gbps = shape.kv_bytes / st.median_us / 1e3
                line += (f"  median {st.median_us:8.1f} us  min {st.min_us:8.1f}  "
                         f"{gbps / 1e3:5.2f} TB/s {100 * gbps / ceiling:5.1f}%  "
                         f"splits {launcher.n_splits}")
            print(line, flush=True)

if __name__ == "__main__":
    main()
