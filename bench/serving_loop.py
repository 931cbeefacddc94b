"""Serving-loop benchmark: ragged batches growing by one token per step, from a paged pool.

For each (batch, KV format, page size): `--steps` decode steps of `batch` sequences with
lengths drawn uniformly from [--lo, --hi] (`RaggedLengths`, seeded: a ragged sweep's batch), one token longer each
step, pages of each sequence placed at shuffled positions of the pool. Measured:
- MLADecodeWrapper, plan + run each step (page table and lengths as device tensors,
  `plan(check=False)`): GPU time per step (CUDA events around the whole loop / steps),
  host time of plan and of plan + run (median per step, perf_counter_ns), builds and
  device allocations after each bucket's first call, the loop under
  torch.cuda.set_sync_debug_mode("error");
- CUDA graphs: a `use_cuda_graph=True` wrapper (each plan copies the metadata into its
  buffers), `run` captured once per bucket and replayed after each step's plan: GPU time,
  host time of plan + replay; and a graph of the default wrapper replayed with each step's
  tables written into the captured tensors (as a server's graph-static buffers are; the
  writes are the server's and untimed): host time of plan + replay; both compared with
  eager element for element;
- a server's buffers: each step's tables written into the same tensors (untimed), then
  plan + run of a default wrapper, whose runs replay a graph of their launches once the
  addresses repeat (launch graphs): host time of plan and plan + run, graphs captured,
  outputs compared with eager;
- the other merge mode of the same balanced runners (fused / second launch): GPU time of
  the wrapper's and the task path's kernels, host time of plan + its launches;
- `Dispatcher.run` on the task tuples of the same steps (contiguous ragged KV, no kv_lens;
  what `submission.custom_kernel` calls, with `check_inputs=False` as there): GPU time per
  step, builds and allocations after the first call;
- the same tokens as a uniform batch (batch x mean length): through `Dispatcher.run` (the
  exact winner or the nearest tuned shape's variant), and the best tuned variant built for
  that uniform shape (the bucket's winner with per-sequence splits, or a tuned winner of
  a uniform shape of the same batch within 2x of the length, each checked first); the
  better of the two is the reference of the ratio columns;
- FlashInfer's BatchMLAPagedAttentionWrapper, plan + run each step on the same pool and
  page tables (its JIT compile happens in an untimed first plan/run).
`--explore` adds, per loop, the task path's balanced runner at other program counts and
per-sequence setup charges (runtime arguments of the same kernels).

Run on the GPU machine after `source .device/setup.sh`:
    python3 bench/serving_loop.py --db shipped
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mla_tune.problem import quant  # noqa: E402
from mla_tune.problem.reference import mla_decode_reference  # noqa: E402
from mla_tune.problem.shapes import QK_HEAD_DIM, SM_SCALE, RaggedLengths, Shape  # noqa: E402
from mla_tune.runtime.dispatcher import Dispatcher  # noqa: E402
from mla_tune.runtime.wrapper import MLADecodeWrapper  # noqa: E402


def allocations(dev: torch.device) -> int:
    """Device allocations the caching allocator has handed out so far."""
    return int(torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0))


class Loop:
    """One (batch, format, page size) loop: pool, per-step page tables, task tuples."""

    def __init__(self, batch: int, fmt: str, page: int, steps: int, lo: int, hi: int,
                 seed: int, dev: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        self.batch, self.fmt, self.page, self.steps, self.dev = batch, fmt, page, steps, dev
        # Step 0 is the batch a ragged sweep of the same distribution and seed tunes
        # (`--ragged uniform:LO-HI --ragged-seed SEED`, suite `serving`).
        self.lens0 = list(RaggedLengths.parse(f"uniform:{lo}-{hi}", seed).draw(batch))
        final = [L + steps for L in self.lens0]
        n_pages = [-(-L // page) for L in final]
        total_pages = sum(n_pages) + 8
        perm = torch.randperm(total_pages, generator=g).tolist()
        self.pages: list[list[int]] = []
        k = 0
        for n in n_pages:
            self.pages.append(perm[k:k + n])
            k += n
        dg = torch.Generator(device=dev).manual_seed(seed)
        pool = torch.randn((total_pages, page, QK_HEAD_DIM), generator=dg, device=dev,
                           dtype=torch.float32).to(torch.bfloat16)
        if fmt == "bf16":
            self.cache: Any = pool
            self.flat = pool.view(-1, 1, QK_HEAD_DIM)
            self.scale_f = None
        else:
            vals, scale = quant.quantize_fp8(pool)
            self.cache = (vals, scale)
            self.flat = vals.view(-1, 1, QK_HEAD_DIM)
            self.scale_f = float(scale)
        self.qo = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.q = torch.randn((batch, 16, QK_HEAD_DIM), generator=dg, device=dev,
                             dtype=torch.float32).to(torch.bfloat16)
        # Per step: lengths and page table (device and host copies), prepared untimed.
        self.tables = self.page_tables(self.pages)
        # Task tuples of the same steps: contiguous ragged KV (rows = sum of lengths) as a
        # view of one buffer (values are not the pool's; only timing and routing use them).
        self.tasks = []
        for lens, _, _ in self.tables:
            rows = sum(lens)
            kvp = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=dev)
            if rows > self.flat.shape[0]:
                raise SystemExit(f"pool too small for {rows} contiguous rows")
            entry: Any = self.flat[:rows]
            if fmt == "fp8":
                entry = (entry, self.cache[1])
            self.tasks.append((self.q, {fmt: entry}, self.qo, kvp,
                               Shape(batch, tuple(lens)).task_config()))

    def page_tables(self, pages: list[list[int]]) -> list[tuple[list[int], tuple, tuple]]:
        """Per step: (lengths, (kv_indptr, kv_indices, kv_lens) on the host, the same on the
        device), sequence b's pages being `pages[b]` (in the order it reads them)."""
        out = []
        page_t = [torch.tensor(p, dtype=torch.int32) for p in pages]
        for s in range(self.steps):
            lens = [L + s + 1 for L in self.lens0]
            used = [-(-L // self.page) for L in lens]
            idx = torch.cat([t[:n] for t, n in zip(page_t, used)])
            ptr = torch.tensor([0] + _cumsum(used), dtype=torch.int32)
            host = (ptr, idx, torch.tensor(lens, dtype=torch.int32))
            out.append((lens, host, tuple(t.to(self.dev) for t in host)))
        return out

    def mean_len(self) -> int:
        return round(sum(self.tables[self.steps // 2][0]) / self.batch)


class ServerBuffers:
    """A server's persistent metadata tensors for a loop, sized for its last (largest)
    step; each step's tables are written into them, the page indices passed as a view of
    their buffer as long as the step's pages (a new object at the same address)."""

    def __init__(self, loop: Loop) -> None:
        _, _, (ptr, idx, lens) = loop.tables[loop.steps - 1]
        self.loop = loop
        self.ptr, self.idx, self.lens = ptr.clone(), torch.zeros_like(idx), lens.clone()

    def fill(self, s: int) -> torch.Tensor:
        """Step s's tables written into the buffers; the view of the page indices."""
        _, _, (ptr, idx, lens) = self.loop.tables[s]
        self.ptr.copy_(ptr)
        self.idx[:idx.numel()].copy_(idx)
        self.lens.copy_(lens)
        return self.idx[:idx.numel()]

    def timed_step(self, w: MLADecodeWrapper, s: int) -> tuple[float, float, torch.Tensor]:
        """Step s through `w` as a server runs it: the tables written (untimed), then
        `plan(check=False)` and `run`, each timed: (plan µs, run µs, output)."""
        loop = self.loop
        view = self.fill(s)
        t0 = time.perf_counter_ns()
        w.plan(loop.qo, self.ptr, view, self.lens, check=False)
        t1 = time.perf_counter_ns()
        out = w.run(loop.q, loop.cache)
        t2 = time.perf_counter_ns()
        return (t1 - t0) / 1e3, (t2 - t1) / 1e3, out


def _cumsum(xs: list[int]) -> list[int]:
    out, t = [], 0
    for x in xs:
        t += x
        out.append(t)
    return out


def gpu_loop_us(fn, steps: int, reps: int = 3) -> float:
    """Median over `reps` of (GPU time of `steps` calls of fn(step)) / steps, in us."""
    res = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for s in range(steps):
            fn(s)
        b.record()
        b.synchronize()
        res.append(a.elapsed_time(b) * 1000 / steps)
    return statistics.median(res)


def reference(loop: Loop, step: int, pages: list[list[int]] | None = None) -> torch.Tensor:
    """The float32 reference of `step`, from the pool's pages gathered in order (sequence
    b's pages: `pages[b]`, by default the loop's own)."""
    lens = loop.tables[step][0]
    rows = []
    for b, L in enumerate(lens):
        pg = torch.tensor((pages or loop.pages)[b][:-(-L // loop.page)], device=loop.dev)
        r = (pg[:, None] * loop.page + torch.arange(loop.page, device=loop.dev)).reshape(-1)
        rows.append(r[:L])
    kv = loop.flat[torch.cat(rows)]
    entry = kv if loop.fmt == "bf16" else (kv, loop.cache[1])
    kvp = torch.tensor([0] + _cumsum(lens), dtype=torch.int32, device=loop.dev)
    return mla_decode_reference(loop.q, {loop.fmt: entry}, loop.qo, kvp,
                                Shape(loop.batch, tuple(lens)).task_config(),
                                kv_format=loop.fmt)


def host_times(loop: Loop, plan, run) -> tuple[float, float]:
    """Median host time (us) of plan and of plan + run per step, the GPU kept busy."""
    t_plan, t_all = [], []
    for s in range(loop.steps):
        _, _, (ptr, idx, lens) = loop.tables[s]
        t0 = time.perf_counter_ns()
        plan(ptr, idx, lens)
        t1 = time.perf_counter_ns()
        run()
        t2 = time.perf_counter_ns()
        t_plan.append((t1 - t0) / 1e3)
        t_all.append((t2 - t0) / 1e3)
    return statistics.median(t_plan), statistics.median(t_all)


def uniform_tuned(disp: Dispatcher, bucket_decision: Any, ushape: Shape, utask: tuple,
                  uref: torch.Tensor, steps: int) -> tuple[float, str]:
    """The best GPU time per call of a tuned variant built for the uniform shape `ushape`,
    and which: the bucket's own winner (per-sequence splits) and the tuned winners of
    uniform shapes of the same batch within 2x of its length (in every family the DB
    holds), each checked against the reference first (a wrong or unbuildable one is
    skipped)."""
    from mla_tune.backends import get_backend

    cands = [("bucket winner", bucket_decision.backend, bucket_decision.config)]
    for w in disp._uniform.get((ushape.kv_format, ushape.heads, ushape.q_len, 1), []):
        s = w.winner.shape
        if s.batch == ushape.batch and ushape.kv_lens[0] / 2 <= s.kv_lens[0] <= \
                2 * ushape.kv_lens[0]:
            cands.append((f"{s.batch}x{s.kv_lens[0]}'s", w.winner.backend, w.config))
    tol = 0.1 if ushape.kv_format.value == "fp8" else 0.02
    best, note = math.nan, ""
    for name, backend, config in cands:
        try:
            fn = get_backend(backend).build(ushape, config, utask[0].device)
            if float((fn(utask).float() - uref).abs().max()) > tol:
                continue
            us = gpu_loop_us(lambda s, fn=fn: fn(utask), steps)
        except Exception:  # noqa: BLE001 - a variant that does not build is skipped
            continue
        if math.isnan(best) or us < best:
            best, note = us, f"uniform tuned: {name} {backend} winner"
    return best, note


def run_loop(loop: Loop, disp: Dispatcher, fi_ok: bool, explore: bool) -> dict[str, Any]:
    dev, steps = loop.dev, loop.steps
    r: dict[str, Any] = {}
    w = MLADecodeWrapper(loop.fmt, 16, 1, loop.page, dev, dispatcher=disp)

    def plan(ptr, idx, lens) -> None:
        w.plan(loop.qo, ptr, idx, lens, check=False)

    def step(s: int) -> torch.Tensor:
        _, _, (ptr, idx, lens) = loop.tables[s]
        w.plan(loop.qo, ptr, idx, lens, check=False)
        return w.run(loop.q, loop.cache)

    # First call of each bucket (builds), then count what later calls build or allocate.
    seen = set()
    for s in range(steps):
        step(s)
        seen.add(w.bucket)
    torch.cuda.synchronize()
    _, _, (ptr, idx, lens) = loop.tables[steps - 1]
    w.plan(loop.qo, ptr, idx, lens, check=True)
    r["max_err"] = float((w.run(loop.q, loop.cache).float() - reference(loop, steps - 1))
                         .abs().max())
    r["buckets"] = sorted(b.label() for b in seen)
    runner = w._route.runner
    r["decision"] = runner.decision.describe()
    launcher = getattr(runner, "launcher", None)
    r["programs"] = f"{launcher.programs} (wave {launcher.slots})" if launcher else "-"
    r["merge"] = launcher.merge if launcher else "-"
    b0, a0 = w.builds, allocations(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(steps):
            step(s)
        r["sync"] = "none raised"
    except RuntimeError as e:
        r["sync"] = f"raised: {e}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    r["host_plan_us"], r["host_us"] = host_times(loop, plan, lambda: w.run(loop.q, loop.cache))
    r["wrapper_gpu_us"] = gpu_loop_us(step, steps)
    torch.cuda.synchronize()
    r["builds_after"], r["allocs_after"] = w.builds - b0, allocations(dev) - a0
    eager = [step(s).clone() for s in range(steps)]

    # use_cuda_graph=True: plan copies into the wrapper's buffers; run captured per bucket.
    wg = MLADecodeWrapper(loop.fmt, 16, 1, loop.page, dev, dispatcher=disp,
                          use_cuda_graph=True)
    graphs: dict[Any, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def gplan(ptr, idx, lens) -> None:
        wg.plan(loop.qo, ptr, idx, lens, check=False)

    def greplay() -> None:
        graphs[wg.bucket][0].replay()

    replays = []
    for s in range(steps):
        _, _, (ptr, idx, lens) = loop.tables[s]
        gplan(ptr, idx, lens)
        if wg.bucket not in graphs:
            wg.run(loop.q, loop.cache)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                o = wg.run(loop.q, loop.cache)
            graphs[wg.bucket] = (g, o)
        greplay()
        replays.append(graphs[wg.bucket][1].clone())
    torch.cuda.synchronize()
    r["graph_equal"] = all(torch.equal(a, b) for a, b in zip(eager, replays))

    def gstep(s: int) -> None:
        _, _, (ptr, idx, lens) = loop.tables[s]
        gplan(ptr, idx, lens)
        greplay()

    a0 = allocations(dev)
    r["graph_gpu_us"] = gpu_loop_us(gstep, steps)
    r["graph_host_plan_us"], r["graph_host_us"] = host_times(loop, gplan, greplay)
    torch.cuda.synchronize()
    r["graph_allocs_after"] = allocations(dev) - a0

    # The default wrapper captured once, each step's tables written into those tensors
    # (sized for the last step's), replayed for the steps of the captured bucket.
    # (A wrapper of its own: after the capture, plans of that bucket must bring those
    # tensors.)
    wd = MLADecodeWrapper(loop.fmt, 16, 1, loop.page, dev, dispatcher=disp)
    bufs = ServerBuffers(loop)
    wd.plan(loop.qo, bufs.ptr, bufs.fill(0), bufs.lens, check=False)
    wd.run(loop.q, loop.cache)  # warm
    torch.cuda.synchronize()
    captured = wd.bucket
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o = wd.run(loop.q, loop.cache)
    replays, t_host = [], []
    for s in range(steps):
        idx_v = bufs.fill(s)
        t0 = time.perf_counter_ns()
        wd.plan(loop.qo, bufs.ptr, idx_v, bufs.lens, check=False)
        if wd.bucket == captured:
            g.replay()
            t_host.append((time.perf_counter_ns() - t0) / 1e3)
            replays.append((s, o.clone()))  # compared after the loop: no sync in it
    torch.cuda.synchronize()
    r["graph_equal_direct"] = bool(replays) and all(torch.equal(out, eager[s])
                                                    for s, out in replays)
    r["direct_graph_host_us"] = statistics.median(t_host) if t_host else math.nan

    # A server's loop: each step's tables written into the same buffers (the writes are
    # the server's, untimed), then plan + run of a default wrapper, whose runs launch a
    # graph of the step's kernels once the addresses repeat (launch graphs).
    # Outputs are compared after the timed pass: a comparison syncs, and a plan right
    # after a sync took up to twice the host time of one with the GPU busy (an H100 host).
    ws = MLADecodeWrapper(loop.fmt, 16, 1, loop.page, dev, dispatcher=disp)
    outs, t_plan, t_host = [], [], []
    for rep in range(2):
        for s in range(steps):
            t_p, t_r, o = bufs.timed_step(ws, s)
            if rep:
                t_plan.append(t_p)
                t_host.append(t_p + t_r)
                outs.append(o.clone())
    torch.cuda.synchronize()
    r["buffers_equal"] = all(torch.equal(out, eager[s]) for s, out in enumerate(outs))
    r["buffers_host_plan_us"] = statistics.median(t_plan)
    r["buffers_host_us"] = statistics.median(t_host)
    r["buffers_captures"] = sum(rt.graphed.captures for rt in ws._routes.values()
                                if rt.graphed is not None)

    # custom_kernel on the task tuples (no kv_lens).
    from mla_tune.runtime.buckets import router_for

    router = router_for(disp)
    for t in loop.tasks:
        disp.run(t)
    torch.cuda.synchronize()
    cb0, ca0 = router.builds, allocations(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in loop.tasks:
            disp.run(t)
        r["task_sync"] = "none raised"
    except RuntimeError as e:
        r["task_sync"] = f"raised: {e}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    r["task_gpu_us"] = gpu_loop_us(lambda s: disp.run(loop.tasks[s]), steps)
    torch.cuda.synchronize()
    r["task_builds_after"], r["task_allocs_after"] = router.builds - cb0, \
        allocations(dev) - ca0
    task_runner = next(reversed(router._task.values())).runner
    last = loop.tasks[-1]
    ref = mla_decode_reference(*last, kv_format=loop.fmt)
    r["task_err"] = float((disp.run(last).float() - ref).abs().max())

    # The same tokens as a uniform batch: the dispatcher's route, and the variant the
    # bucket adapts built with per-sequence splits for that shape.
    mean = loop.mean_len()
    ushape = Shape.uniform(loop.batch, mean, kv_format=loop.fmt)
    rows = ushape.total_kv
    kv_u = loop.flat[:rows] if loop.fmt == "bf16" else (loop.flat[:rows], loop.cache[1])
    utask = (loop.q, {loop.fmt: kv_u}, loop.qo,
             torch.arange(loop.batch + 1, dtype=torch.int32, device=dev) * mean,
             ushape.task_config())
    disp.run(utask)
    r["uniform_shape"] = f"{loop.batch}x{mean}"
    r["uniform_gpu_us"] = gpu_loop_us(lambda s: disp.run(utask), steps)
    uref = mla_decode_reference(*utask, kv_format=loop.fmt)
    r["uniform_tuned_us"], r["uniform_tuned_note"] = uniform_tuned(
        disp, task_runner.decision, ushape, utask, uref, steps)
    r["uniform_err"] = float((disp.run(utask).float() - uref).abs().max())
    router.run_task(utask)
    r["uniform_balanced_us"] = gpu_loop_us(lambda s: router.run_task(utask), steps)
    r.update(other_merge(loop, w, task_runner))

    if explore:
        r["explore"] = explore_loop(loop, task_runner)

    r["fi_us"] = r["fi_run_us"] = math.nan
    r["fi_note"] = ""
    if fi_ok:
        try:
            r.update(flashinfer_loop(loop))
        except Exception as e:  # noqa: BLE001 - the baseline failing is a result
            r["fi_note"] = f"{type(e).__name__}: {str(e)[:160]}"
    return r


def other_merge(loop: Loop, w: MLADecodeWrapper, task_runner: Any) -> dict[str, Any]:
    """The wrapper's and the task path's balanced runners rebuilt with the other merge mode
    (the same compiled kernels): GPU time per step, host time of plan + its launches."""
    from mla_tune.kernels.triton.mla_decode import MERGE_FUSED, MERGE_SEPARATE, BalancedLauncher

    route = w._route
    base = getattr(route.runner, "launcher", None)
    tbase = getattr(task_runner, "launcher", None)
    if base is None or tbase is None:
        return {"alt_merge": "-"}
    mode = MERGE_SEPARATE if base.merge == MERGE_FUSED else MERGE_FUSED
    fmt, steps = loop.fmt, loop.steps
    scale = None if fmt == "bf16" else loop.cache[1]
    pool = loop.cache if fmt == "bf16" else loop.cache[0]
    out: dict[str, Any] = {"alt_merge": mode}

    def rebuild(L: Any, sched: int) -> Any:
        n = BalancedLauncher(L.cfg, heads=16, q_len=1, batch=loop.batch, device=loop.dev,
                             sched=sched, page_size=L.page_size, sm_scale=SM_SCALE,
                             programs=L.programs, merge=mode)
        n.prepare()
        return n

    P = rebuild(base, base.sched)
    T = rebuild(tbase, tbase.sched)

    def pstep(s: int) -> None:
        _, _, (ptr, idx, lens) = loop.tables[s]
        P(loop.q, pool, scale, None, loop.qo, lens, ptr, idx)

    def tstep(s: int) -> None:
        q, kvd, qo, kvp, _ = loop.tasks[s]
        e = kvd[fmt]
        T(q, e if fmt == "bf16" else e[0], scale, None, qo, kvp)

    pstep(0)
    tstep(0)
    out["alt_wrapper_gpu_us"] = gpu_loop_us(pstep, steps)
    out["alt_task_gpu_us"] = gpu_loop_us(tstep, steps)
    # Host: the wrapper's plan, then this runner's launches from the wrapper's pointers.
    w.run(loop.q, loop.cache)

    def plan(ptr, idx, lens) -> None:
        w.plan(loop.qo, ptr, idx, lens, check=False)

    def run() -> None:
        kv_p, sc_p, scs_p, stride = route.pool_ptrs[:4]
        qo_p, lens_p, ptr_p, idx_p = w._ptrs
        P.launch_ptrs(w._q_ptr, kv_p, sc_p if scale is not None else P.dummy_ptrs[0],
                      P.dummy_ptrs[1], 0, qo_p, lens_p, idx_p, ptr_p)

    _, out["alt_host_us"] = host_times(loop, plan, run)
    torch.cuda.synchronize()
    return out


def explore_loop(loop: Loop, task_runner: Any) -> str:
    """The task path's balanced runner at other program counts and per-sequence setup
    charges (runtime arguments of the same kernels), us per step."""
    L = getattr(task_runner, "launcher", None)
    if L is None:
        return ""
    fmt = loop.fmt
    scale = None if fmt == "bf16" else loop.cache[1]

    def call(s: int) -> None:
        q, kvd, qo, kvp, _ = loop.tasks[s]
        e = kvd[fmt]
        L(q, e if fmt == "bf16" else e[0], scale, None, qo, kvp)

    base, seg = L.programs, L.seg_cost
    res = []
    for waves, cost in ((0.5, seg), (2, seg), (1, 0), (1, 2), (1, 4)):
        L.set_programs(max(1, int(waves * L.slots)), cost)
        call(0)
        res.append(f"{L.programs}p/seg{cost}/{L.merge}:{gpu_loop_us(call, loop.steps):.1f}")
    L.set_programs(base, seg)
    return "task " + " ".join(res)


def host_costs(dev: torch.device) -> str:
    """ns per call of the tensor queries and the capture check a plan/run makes, here."""
    import timeit

    t = torch.zeros(64, dtype=torch.int32, device=dev)
    res = []
    for name, fn in (("data_ptr", t.data_ptr), ("get_device", t.get_device),
                     ("is_contiguous", t.is_contiguous), ("dtype", lambda: t.dtype),
                     ("shape", lambda: t.shape),
                     ("capturing", torch._C._cuda_isCurrentStreamCapturing)):
        n = 20000
        res.append(f"{name} {timeit.timeit(fn, number=n) / n * 1e9:.0f}")
    return ", ".join(res) + " ns"


def flashinfer_loop(loop: Loop) -> dict[str, Any]:
    import flashinfer.mla as fmla

    dev = loop.dev
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    w = fmla.BatchMLAPagedAttentionWrapper(ws, backend="auto")
    fp8 = loop.fmt == "fp8"
    kw: dict[str, Any] = dict(num_heads=16, head_dim_ckv=512, head_dim_kpe=64,
                              page_size=loop.page, causal=False, sm_scale=SM_SCALE,
                              q_data_type=torch.bfloat16,
                              kv_data_type=loop.cache[0].dtype if fp8 else torch.bfloat16,
                              query_layout="packed", kv_cache_layout="packed")
    if fp8:
        kw["scale_mode"] = "kv-per-tensor"
    pool = loop.cache[0] if fp8 else loop.cache
    run_kw: dict[str, Any] = {"ckv_scale": loop.scale_f, "kpe_scale": loop.scale_f} if fp8 else {}
    qo_h = torch.arange(loop.batch + 1, dtype=torch.int32)

    def step(s: int) -> torch.Tensor:
        _, (ptr, idx, lens), _ = loop.tables[s]
        w.plan(metadata=fmla.MLAPlanMetadata.csr(qo_indptr=qo_h, kv_indptr=ptr,
                                                 kv_indices=idx, kv_len_arr=lens), **kw)
        return w.run(query=loop.q, kv_cache=pool, **run_kw)

    step(0)  # JIT compile, untimed
    torch.cuda.synchronize()
    out: dict[str, Any] = {"fi_us": gpu_loop_us(step, loop.steps),
                           "fi_backend": getattr(w, "_planned_backend_name", "?")}
    step(loop.steps - 1)

    def run_only(s: int) -> torch.Tensor:
        return w.run(query=loop.q, kv_cache=pool, **run_kw)

    out["fi_run_us"] = gpu_loop_us(run_only, loop.steps)
    return out


def python_speed_ns() -> float:
    """ns per iteration of a fixed pure-Python loop: compares this host's single-thread
    speed with another's (host times scale with it)."""
    t0 = time.perf_counter_ns()
    x = 0
    for i in range(200000):
        x += i & 7
    return (time.perf_counter_ns() - t0) / 200000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default="shipped", help="winners: tuning DB (URL, path, shipped)")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--pages", default="1,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--lo", type=int, default=300)
    ap.add_argument("--hi", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--explore", action="store_true",
                    help="also other program counts and paged read variants")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    disps = {f: Dispatcher.from_db(args.db, dev, kv_format=f, check_inputs=False)
             for f in args.formats.split(",")}
    print(f"# {next(iter(disps.values())).summary()}")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, "
          f"python loop {python_speed_ns():.1f} ns/iter; CUDA tensor queries: "
          f"{host_costs(dev)}")

    fi_ok = not args.no_flashinfer
    if fi_ok:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:  # noqa: BLE001
            print(f"# FlashInfer unavailable: {e}")
            fi_ok = False
    cols = ["batch", "fmt", "page", "merge", "wrapper", "graph", "task",
            "uniform route (shape)", "uniform tuned", "uniform balanced", "wrapper / ref",
            "task / ref", "FI plan+run", "FI run", "host plan / plan+run",
            "host, server buffers: plan / plan+run (graphs)",
            "host graph plan+replay (copy / direct)", "wrapper b/a", "graph a", "task b/a",
            "sync", "graph==eager", "err wrapper / task / uniform",
            "other merge: wrapper / task / host"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    notes = []
    for batch in map(int, args.batches.split(",")):
        for fmt in args.formats.split(","):
            for page in map(int, args.pages.split(",")):
                t0 = time.time()
                try:
                    loop = Loop(batch, fmt, page, args.steps, args.lo, args.hi, args.seed,
                                dev)
                    r = run_loop(loop, disps[fmt], fi_ok, args.explore)
                except Exception:  # noqa: BLE001 - report and go on with the next loop
                    torch.cuda.set_sync_debug_mode("default")
                    print(f"# {batch} {fmt} p{page} failed:\n" + traceback.format_exc()[-1500:],
                          flush=True)
                    continue
                ref = min(x for x in (r["uniform_gpu_us"], r["uniform_tuned_us"])
                          if not math.isnan(x))
                sync = r["sync"] == r["task_sync"] == "none raised"
                alt = (f"{r['alt_merge']}: {r['alt_wrapper_gpu_us']:.1f} / "
                       f"{r['alt_task_gpu_us']:.1f} / {r['alt_host_us']:.1f}"
                       if "alt_host_us" in r else "-")
                print(f"| {batch} | {fmt} | {page} | {r['merge']} | {r['wrapper_gpu_us']:.1f} | "
                      f"{r['graph_gpu_us']:.1f} | {r['task_gpu_us']:.1f} | "
                      f"{r['uniform_gpu_us']:.1f} ({r['uniform_shape']}) | "
                      f"{r['uniform_tuned_us']:.1f} | {r['uniform_balanced_us']:.1f} | "
                      f"{r['wrapper_gpu_us'] / ref:.2f} | {r['task_gpu_us'] / ref:.2f} | "
                      f"{r['fi_us']:.1f} | {r['fi_run_us']:.1f} | "
                      f"{r['host_plan_us']:.1f} / {r['host_us']:.1f} | "
                      f"{r['buffers_host_plan_us']:.1f} / {r['buffers_host_us']:.1f} "
                      f"({r['buffers_captures']}) | "
                      f"{r['graph_host_us']:.1f} / {r['direct_graph_host_us']:.1f} | "
                      f"{r['builds_after']}/{r['allocs_after']} | {r['graph_allocs_after']} | "
                      f"{r['task_builds_after']}/{r['task_allocs_after']} | "
                      f"{'ok' if sync else 'RAISED'} | "
                      f"{r['graph_equal'] and r['graph_equal_direct'] and r['buffers_equal']} | "
                      f"{r['max_err']:.4f} / {r['task_err']:.4f} / "
                      f"{r['uniform_err']:.4f} | {alt} |", flush=True)
                notes.append(f"# {batch} {fmt} p{page}: buckets {r['buckets']}; "
                             f"{r['decision']}; programs {r['programs']}; "
                             f"sync {r['sync']} / {r['task_sync']}; graph plan "
                             f"{r['graph_host_plan_us']:.1f} us; "
                             f"{r.get('uniform_tuned_note', '')} "
                             f"FlashInfer {r.get('fi_backend', '')} {r['fi_note']}; "
                             f"{r.get('explore', '')}; {time.time() - t0:.0f} s")
                del loop
                torch.cuda.empty_cache()
    for n in notes:
        print(n)


if __name__ == "__main__":
    main()
