"""Time (or hand to a profiler) chosen variants of a compiled-source family on a GPU: a dev
script for kernel work, not a test and not the tuner.

Each variant is `FORMAT:BATCHxKV:KNOB=V,...` with all of the family's knobs (macros and
runtime knobs alike), e.g. `fp8:128x8192:BN=64,MT=1,LOAD=1,QK=0,SPLITS=2,MERGE=0,CLUSTER=0`.
Every variant is built through the backend, judged by the sweep's gate against the float32 reference, then timed
with the tuner's timer (cold L2 before every call); each line gives median, minimum,
effective TB/s and the share of the device's read ceiling.

    python3 bench/compiled_probe.py --backend cuda_mma VARIANT [VARIANT ...]
    ncu --kernel-name mla_split --launch-skip 1 --launch-count 1 \\
        python3 bench/compiled_probe.py --backend cuda_mma --once VARIANT

`--once` launches each variant once more after its check (so the check's launch is the one
to skip in a profiler).
"""

from __future__ import annotations

import argparse

import torch

import benchkit
from mla_tune.backends import get_backend
from mla_tune.tuning.space import ConfigError, ParamSpace
from mla_tune.tuning.timing import CudaTimer, TimingPolicy


def parse(text: str, heads: int, space: ParamSpace) -> tuple:
    """'FORMAT:BATCHxKV:K=V,...' -> (shape, a point of the family's space)."""
    shape, config = benchkit.parse_int_knobs(text, heads)
    try:
        return shape, space.validate(config)
    except ConfigError as e:
        raise SystemExit(f"bad variant {text!r}: {e}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--backend", default="cuda_mma")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--once", action="store_true", help="launch once after the check")
    ap.add_argument("--budget", type=float, default=0.5, help="timing budget per variant, s")
    a = ap.parse_args()
    dev = torch.device("cuda")
    backend = get_backend(a.backend)
    timer = None if a.once else CudaTimer(dev, TimingPolicy(
        warmup=3, min_runs=20, max_runs=300, budget_s=a.budget))
    ceiling = None if a.once else benchkit.read_ceiling_gbps()
    space = backend.declared_space(dev)
    for text in a.variants:
        shape, config = parse(text, a.heads, space)
        data = benchkit.task_input(shape, dev)
        ref = benchkit.reference(data, shape.kv_format)
        try:
            run = backend.build(shape, config, dev)
        except RuntimeError as e:  # e.g. a variant that spills: say so, go on with the rest
            print(f"{text:60} skipped: {e}", flush=True)
            continue
        res = benchkit.check(run(data), ref, shape.kv_format)
        line = (f"{text:60} {'ok' if res.ok else 'WRONG'} err {res.max_abs_err:.3g} "
                f"mism {res.mismatch_frac:.2%}")
        if a.once:
            run(data)
            torch.cuda.synchronize()
        else:
            st = timer.measure(lambda: run(data))
            gbps = shape.kv_bytes / st.median_us / 1e3
            line += (f"  median {st.median_us:8.1f} us  min {st.min_us:8.1f}  "
                     f"{gbps / 1e3:5.2f} TB/s {100 * gbps / ceiling:5.1f}%")
        print(line, flush=True)


if __name__ == "__main__":
    main()
