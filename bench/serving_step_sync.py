"""Host time of a server-buffer step with and without a synchronization before it.

`bench/serving_loop.py`'s server-buffer loop (each step's tables copied into one set of
tensors, the page indices a new view of their buffer, `plan(check=False)` + `run` of a
default wrapper) timed under three ways of ending a step: comparing its output with the
eager output (`torch.equal`, a synchronization: what that loop did), `synchronize()`,
and nothing (the GPU kept busy, the host running ahead). Modes are interleaved (equal,
sync, none, equal, none) so that drift shows; each is 3 passes over the steps, the first
untimed. Also counts how often the wrapper's view-only plan path answered.

    python3 bench/serving_step_sync.py --loops 32:bf16:64,128:fp8:1
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import benchkit  # noqa: F401 - refuses to run against another checkout
from mla_tune import MLADecodeWrapper
from mla_tune.runtime.dispatcher import Dispatcher
from serving_loop import Loop, ServerBuffers

MODES = ("equal", "sync", "none", "equal", "none")


def spread(xs: list[float]) -> str:
    """Median (p10, p90) of host times, µs."""
    xs = sorted(xs)
    return (f"{statistics.median(xs):.2f} (p10 {xs[len(xs) // 10]:.2f} "
            f"p90 {xs[9 * len(xs) // 10]:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loops", default="32:bf16:64,128:fp8:1",
                    help="batch:format:page, comma-separated")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--db", default="shipped")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("serving_step_sync.py times host work around GPU launches: no CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    for spec in a.loops.split(","):
        batch, fmt, page = spec.split(":")
        batch, page = int(batch), int(page)
        disp = Dispatcher.from_db(a.db, dev, kv_format=fmt, check_inputs=False)
        loop = Loop(batch, fmt, page, a.steps, 300, 8000, 0, dev)
        bufs = ServerBuffers(loop)
        w = MLADecodeWrapper(fmt, 16, 1, page, dev, dispatcher=disp)
        eager = [bufs.timed_step(w, s)[2].clone() for s in range(a.steps)]
        torch.cuda.synchronize()
        view_only = w._plan_new_indices
        answered = [0, 0]

        def counting(*args: object) -> bool:
            ok = view_only(*args)
            answered[0] += ok
            answered[1] += 1
            return ok

        w._plan_new_indices = counting
        for mode in MODES:
            t_plan, t_run, t_all = [], [], []
            answered[:] = [0, 0]
            for rep in range(3):
                for s in range(a.steps):
                    t_p, t_r, out = bufs.timed_step(w, s)
                    if rep:
                        t_plan.append(t_p)
                        t_run.append(t_r)
                        t_all.append(t_p + t_r)
                    if mode == "equal":
                        if not torch.equal(out, eager[s]):
                            sys.exit(f"{spec} step {s}: output differs from eager")
                    elif mode == "sync":
                        torch.cuda.synchronize()
                torch.cuda.synchronize()
            print(f"{batch} {fmt} p{page} {mode:5s}: plan {spread(t_plan)} run {spread(t_run)} "
                  f"plan+run {spread(t_all)}; view-only {answered[0]}/{answered[1]}",
                  flush=True)
        del loop
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
