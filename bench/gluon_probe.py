"""Check and time the Gluon Hopper kernel (kernels/gluon/mla_decode.py) on an sm_90 GPU: a
dev script for kernel work, not a test and not the tuner.

Each variant `FORMAT:BATCHxKV:rows=R,warps=W,stages=S,splits=N[,bufs=B][,ws=D]` is judged by the
sweep's gate against the float32 reference, then timed with the tuner's timer (cold L2
before every call) as a CUDA-graph replay, next to what the shipped DB routes the same shape
to (`Dispatcher.from_db("shipped")`, timed the same way). The family's correctness cases are
tests/backends/test_gluon_family.py's GPU tests:

    python3 bench/gluon_probe.py mxfp4:256x8192:rows=16,warps=8,stages=3,splits=1
"""

from __future__ import annotations

import argparse

import torch

import benchkit
from mla_tune.kernels.gluon.launch import build_variant
from mla_tune.problem.shapes import SM_SCALE, Shape
from mla_tune.tuning.timing import CudaTimer, TimingPolicy


def launcher(data, shape: Shape, **knobs: int):
    """A zero-argument launch of the family's built variant on `data`."""
    cfg = {"bufs": 1, **knobs}
    run = build_variant(shape.kv_format.value, list(shape.kv_lens), shape.q_len, shape.heads, cfg,
                        torch.device("cuda"), SM_SCALE)
    return lambda: run(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--no-route", action="store_true", help="skip the shipped route")
    ap.add_argument("--budget", type=float, default=0.5, help="timing budget per variant, s")
    a = ap.parse_args()
    dev = torch.device("cuda")
    timer = CudaTimer(dev, TimingPolicy(warmup=3, min_runs=20, max_runs=300, budget_s=a.budget))
    dispatcher = None
    routed: set[Shape] = set()
    for text in a.variants:
        shape, k = benchkit.parse_int_knobs(text, a.heads)
        data = benchkit.task_input(shape, dev)
        ref = benchkit.reference(data, shape.kv_format)
        run = launcher(data, shape, **k)
        res = benchkit.check(run(), ref, shape.kv_format)
        st = timer.measure(benchkit.graphed(run))
        tbps = shape.kv_bytes / st.median_us / 1e6
        print(f"{text:55} {'ok' if res.ok else 'WRONG'} err {res.max_abs_err:.3g}  "
              f"median {st.median_us:8.1f} us  min {st.min_us:8.1f}  {tbps:5.2f} TB/s",
              flush=True)
        if not a.no_route and shape not in routed:
            routed.add(shape)
            if dispatcher is None:
                from mla_tune.runtime.dispatcher import Dispatcher
                dispatcher = Dispatcher.from_db("shipped")
            try:
                st = timer.measure(benchkit.graphed(lambda: dispatcher.run(data)))
                print(f"{'  the shipped route':55}    median {st.median_us:8.1f} us  "
                      f"min {st.min_us:8.1f}", flush=True)
            except Exception as e:  # noqa: BLE001 - the probe's figures stand without it
                print(f"  the shipped route failed: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
