"""Where a serving step's host time goes: `MLADecodeWrapper.plan` + `run` taken apart.

For one loop of bench/serving_loop.py (batch, format, page size; the shipped DB's bucket
winner), after the bucket's first step: the median host time per call, over blocks of 50
calls with the GPU kept busy, of
- `plan(check=False)` (device metadata, the fast path) and `run` as a server calls them,
  also with the page indices as a new view of a longer buffer each call, its length
  changing from call to call (a server's persistent buffer, its pages growing), with launch
  graphs (the default: the step's launches replayed from one graph once its
  addresses repeat) and without (`graph_launches=False`: the kernels launched each call);
- the route's launch function with the step's pointers (what `run` calls after its checks);
- the Triton C launcher(s) alone, their argument tuples built beforehand;
- the launch of an empty Triton kernel (the driver's own cost) and an empty Python call,
  for scale;
- a model's step: one plan, then one run per layer, each layer with its own pool and
  query (61 layers, DeepSeek-V3's count; the pools views of one buffer at other offsets),
  per run, with launch graphs and without, and with launch graphs writing each layer's
  output into its own tensor (`run(..., out=)`, as a model's layers keep theirs).

    python3 bench/serving_host_time.py --batch 128 --format bf16 --page 64
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import torch
import triton

import benchkit  # noqa: F401 - refuses to run against another checkout
from mla_tune import MLADecodeWrapper
from mla_tune.problem.shapes import V_HEAD_DIM
from mla_tune.runtime.dispatcher import Dispatcher
from serving_loop import Loop

BLOCK = 50
LAYERS = 61


def per_call_us(fn, blocks: int) -> float:
    """Median over `blocks` blocks of BLOCK calls of the host time per call, µs."""
    out = []
    for _ in range(blocks):
        t0 = time.perf_counter_ns()
        for _ in range(BLOCK):
            fn()
        out.append((time.perf_counter_ns() - t0) / BLOCK / 1e3)
        torch.cuda.synchronize()
    return statistics.median(out)


@triton.jit
def _empty_kernel(X):
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--db", default="shipped")
    ap.add_argument("--layers", type=int, default=LAYERS,
                    help="layers of the model's step (each its own pool and query)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("serving_host_time.py times host work around GPU launches: no CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    disp = Dispatcher.from_db(a.db, dev, kv_format=a.format, check_inputs=False)
    loop = Loop(a.batch, a.format, a.page, 2, 300, 8000, 0, dev)
    w = MLADecodeWrapper(a.format, 16, 1, a.page, dev, dispatcher=disp)
    _, _, (ptr, idx, lens) = loop.tables[1]
    w.plan(loop.qo, ptr, idx, lens, check=False)
    w.run(loop.q, loop.cache)
    torch.cuda.synchronize()
    eager = MLADecodeWrapper(a.format, 16, 1, a.page, dev, dispatcher=disp,
                             graph_launches=False)
    eager.plan(loop.qo, ptr, idx, lens, check=False)
    eager.run(loop.q, loop.cache)
    x = torch.zeros(16, device=dev)
    empty = _empty_kernel.warmup(x, grid=(1,))
    empty_launch = empty.run.launch
    route = w._route
    launcher = route.runner.launcher
    kv_p, scale_p, sc_p, sc_stride = route.pool_ptrs[:4]
    qo_p, lens_p, ptr_p, idx_p = w._ptrs
    q_p = loop.q.data_ptr()
    launch, merge = launcher._raw
    stream = launcher._stream(launcher._dev)
    args1 = (*launcher._head1, stream, *launcher._fix1, q_p, kv_p, kv_p, kv_p, scale_p, sc_p,
             sc_stride, qo_p, lens_p, idx_p, ptr_p, launcher.page_shift, launcher._out_ptr,
             *launcher._mid1, *launcher._tail1)
    launches = [lambda: launch(*args1)]
    if merge is not None:
        launch2, head2, fix2, parts2, rest2 = merge
        args2 = (*head2, stream, *fix2, qo_p, lens_p, *parts2, launcher._out_ptr, *rest2)
        launches.append(lambda: launch2(*args2))

    md = empty.metadata
    empty_args = (1, 1, 1, stream, empty.function, md.launch_cooperative_grid, md.launch_pdl,
                  None, None, empty.packed_metadata, None, None, None, x.data_ptr())

    def noop() -> None:
        return None

    # A server's page-index buffer, longer than the step's pages, passed as a new view each
    # call whose length changes (50 lengths of one bucket; unused entries are never read).
    buf = torch.cat([idx, idx[:64]])
    views = itertools.cycle([buf[:idx.numel() + j] for j in range(50)])

    def plan_view() -> None:
        w.plan(loop.qo, ptr, next(views), lens, check=False)

    # As serving_loop.py's server buffers: the step's tables copied into the buffers, a
    # view made, plan, run (only the plan timed); how often the view-only path answered is
    # counted.
    view_only = w._plan_new_indices
    answered = [0, 0]
    ptr_src, lens_src = ptr.clone(), lens.clone()

    def counting(*args: object) -> bool:
        ok = view_only(*args)
        answered[0] += ok
        answered[1] += 1
        return ok

    def plan_fresh_view_us() -> float:
        out = []
        w._plan_new_indices = counting
        for _ in range(a.blocks):
            for j in range(BLOCK):
                ptr.copy_(ptr_src)
                buf[:idx.numel()].copy_(idx)
                lens.copy_(lens_src)
                v = buf[:idx.numel() + j % 50]
                t0 = time.perf_counter_ns()
                w.plan(loop.qo, ptr, v, lens, check=False)
                out.append((time.perf_counter_ns() - t0) / 1e3)
                w.run(loop.q, loop.cache)
            torch.cuda.synchronize()
        w._plan_new_indices = view_only
        return statistics.median(out)

    rows = {
        "plan(check=False)": lambda: w.plan(loop.qo, ptr, idx, lens, check=False),
        "run": lambda: w.run(loop.q, loop.cache),
        "plan + run": lambda: (w.plan(loop.qo, ptr, idx, lens, check=False),
                               w.run(loop.q, loop.cache)),
        "plan(check=False), a new view of the page indices, its length changing":
            plan_view,
        "plan + run, the same new views": lambda: (plan_view(), w.run(loop.q, loop.cache)),
        "run, eager launches": lambda: eager.run(loop.q, loop.cache),
        "plan + run, eager launches": lambda: (eager.plan(loop.qo, ptr, idx, lens, check=False),
                                               eager.run(loop.q, loop.cache)),
        "route launch (pointers given)": lambda: route.launch(q_p, kv_p, scale_p, sc_p,
                                                              sc_stride, qo_p, lens_p, idx_p,
                                                              ptr_p),
        "stream lookup": lambda: launcher._stream(launcher._dev),
        "Triton C launch, split kernel": launches[0],
    }
    if len(launches) > 1:
        rows["Triton C launch, merge kernel"] = launches[1]
    rows["an empty Triton kernel's C launch"] = lambda: empty_launch(*empty_args)
    rows["empty Python call"] = noop
    print(f"# {a.batch} {a.format} page {a.page}: bucket {route.bucket.label()}, "
          f"{'fused merge' if merge is None else 'second-launch merge'}, "
          f"{launcher.programs} programs; {torch.cuda.get_device_name(dev)}, "
          f"torch {torch.__version__}")
    print("| step part | host µs per call |\n|---|---|")
    for name, fn in rows.items():
        print(f"| {name} | {per_call_us(fn, a.blocks):.2f} |", flush=True)
    us = plan_fresh_view_us()
    print(f"| plan(check=False), a view made after the tables' copies, timed per call | {us:.2f} |")
    print(f"# the view-only path answered {answered[0]} of {answered[1]} such plans")
    print(f"# graphs captured by run: {route.graphed.captures}")
    for name, wr, own_out in (("launch graphs", w, False), ("eager launches", eager, False),
                              ("launch graphs, each layer into its own out", w, True)):
        us = per_layer_run_us(wr, loop, ptr, idx, lens, a.blocks, a.layers, own_out)
        print(f"| a model's step: plan once, run per layer ({a.layers} layers' pools), "
              f"{name}, per run | {us:.2f} |")
    print(f"# graphs captured by run, the model's steps included: {route.graphed.captures}")


def per_layer_run_us(w: MLADecodeWrapper, loop: Loop, ptr: torch.Tensor, idx: torch.Tensor,
                     lens: torch.Tensor, steps: int, layers: int, own_out: bool = False
                     ) -> float:
    """Median over `steps` steps of the host time per run of a step that plans once and
    runs every layer on its own pool and query (`own_out`: into the layer's own output
    tensor, as a model's attention layers write theirs), the GPU synchronized between
    steps (a step's launches stay far below the driver's queue)."""
    vals = loop.cache if loop.fmt == "bf16" else loop.cache[0]
    n = vals.shape[0]
    big = vals.new_zeros((n + layers, *vals.shape[1:]))
    pools: list = [big[i:i + n] for i in range(layers)]
    if loop.fmt != "bf16":
        pools = [(p, loop.cache[1]) for p in pools]
    outs = [torch.empty((loop.q.shape[0], loop.q.shape[1], V_HEAD_DIM), dtype=torch.bfloat16,
                        device=loop.q.device) if own_out else None for _ in range(layers)]
    model = list(zip([loop.q.clone() for _ in range(layers)], pools, outs))
    out = []
    for s in range(steps + 3):  # two steps to capture the layers' graphs, one more to warm
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        w.plan(loop.qo, ptr, idx, lens, check=False)
        for q, pool, o in model:
            w.run(q, pool, out=o)
        if s >= 3:
            out.append((time.perf_counter_ns() - t0) / layers / 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


if __name__ == "__main__":
    main()
