"""Serving-loop benchmark: ragged batches growing by one token per step, from a paged pool.

For each (batch, KV format, page size): `--steps` decode steps of `batch` sequences with
lengths drawn uniformly from [--lo, --hi] (seeded), every sequence one token longer each
step, pages of each sequence placed at shuffled positions of the pool. Measured:
- MLADecodeWrapper, plan + run each step (page table and lengths as device tensors,
  `plan(check=False)`): GPU time per step (CUDA events around the whole loop / steps),
  host time of plan + run (median per step), builds and device allocations after each
  bucket's first call, the loop under torch.cuda.set_sync_debug_mode("error");
- a CUDA graph of `run` captured once per bucket and replayed per step after `plan`,
  compared with the eager outputs element for element, and its GPU time per step;
- `Dispatcher.run` on the task tuples of the same steps (contiguous ragged KV, no kv_lens;
  what `submission.custom_kernel` calls, with `check_inputs=False` as there): GPU time per
  step, builds and allocations after the first call;
- the same tokens as a uniform batch (batch x mean length) through `Dispatcher.run`: the
  tuned runtime's time for that much KV (the exact winner, or the nearest tuned shape's
  variant built for it);
- FlashInfer's BatchMLAPagedAttentionWrapper, plan + run each step on the same pool and
  page tables (its JIT compile happens in an untimed first plan/run).

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

from mla_tune import quant  # noqa: E402
from mla_tune.dispatch import Dispatcher  # noqa: E402
from mla_tune.problem import QK_HEAD_DIM, SM_SCALE, Shape  # noqa: E402
from mla_tune.reference import mla_decode_reference  # noqa: E402
from mla_tune.serving import MLADecodeWrapper  # noqa: E402


def allocations(dev: torch.device) -> int:
    """Device allocations the caching allocator has handed out so far."""
    return int(torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0))


class Loop:
    """One (batch, format, page size) loop: pool, per-step page tables, task tuples."""

    def __init__(self, batch: int, fmt: str, page: int, steps: int, lo: int, hi: int,
                 seed: int, dev: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        self.batch, self.fmt, self.page, self.steps, self.dev = batch, fmt, page, steps, dev
        self.lens0 = [int(x) for x in torch.randint(lo, hi - steps + 1, (batch,),
                                                    generator=g)]
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
        self.tables = []
        page_t = [torch.tensor(p, dtype=torch.int32) for p in self.pages]
        for s in range(steps):
            lens = [L + s + 1 for L in self.lens0]
            used = [-(-L // page) for L in lens]
            idx = torch.cat([t[:n] for t, n in zip(page_t, used)])
            ptr = torch.tensor([0] + _cumsum(used), dtype=torch.int32)
            host = (ptr, idx, torch.tensor(lens, dtype=torch.int32))
            self.tables.append((lens, host, tuple(t.to(dev) for t in host)))
        # Task tuples of the same steps: contiguous ragged KV (rows = sum of lengths) as a
        # view of one buffer (values are not the pool's; only timing and routing use them).
        self.tasks = []
        rows_max = sum(final)
        for lens, _, _ in self.tables:
            rows = sum(lens)
            kvp = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=dev)
            shape = Shape(batch, tuple(lens))
            entry: Any = self.flat[:rows] if rows <= self.flat.shape[0] else None
            if entry is None:
                raise SystemExit(f"pool too small for {rows_max} contiguous rows")
            if fmt == "fp8":
                entry = (entry, self.cache[1])
            self.tasks.append((self.q, {fmt: entry}, self.qo, kvp, shape.task_config()))

    def mean_len(self) -> int:
        return round(sum(self.tables[self.steps // 2][0]) / self.batch)


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


def check_wrapper_output(loop: Loop, w: MLADecodeWrapper, step: int) -> float:
    """Max abs error of the wrapper at `step` against the float32 reference."""
    lens, _, (ptr, idx, lens_d) = loop.tables[step]
    w.plan(loop.qo, ptr, idx, lens_d, check=True)
    out = w.run(loop.q, loop.cache).float()
    rows = []
    for b, L in enumerate(lens):
        pg = torch.tensor(loop.pages[b][:-(-L // loop.page)], device=loop.dev)
        r = (pg[:, None] * loop.page + torch.arange(loop.page, device=loop.dev)).reshape(-1)
        rows.append(r[:L])
    gather = torch.cat(rows)
    kv = loop.flat[gather]
    entry = kv if loop.fmt == "bf16" else (kv, loop.cache[1])
    kvp = torch.tensor([0] + _cumsum(lens), dtype=torch.int32, device=loop.dev)
    ref = mla_decode_reference(loop.q, {loop.fmt: entry}, loop.qo, kvp,
                               Shape(loop.batch, tuple(lens)).task_config(),
                               kv_format=loop.fmt)
    return float((out - ref).abs().max())


def run_loop(loop: Loop, disp: Dispatcher, custom_kernel, fi_ok: bool) -> dict[str, Any]:
    dev, steps = loop.dev, loop.steps
    r: dict[str, Any] = {}
    w = MLADecodeWrapper(loop.fmt, 16, 1, loop.page, dev, dispatcher=disp)
    r["max_err"] = check_wrapper_output(loop, w, steps - 1)

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
    r["buckets"] = sorted(b.label() for b in seen)
    r["decision"] = w._runner.decision.describe() if w._runner else ""
    b0, a0 = w.builds, allocations(dev)
    host, host_plan = [], []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(steps):
            _, _, (ptr, idx, lens) = loop.tables[s]
            t0 = time.perf_counter()
            w.plan(loop.qo, ptr, idx, lens, check=False)
            t1 = time.perf_counter()
            w.run(loop.q, loop.cache)
            host.append((time.perf_counter() - t0) * 1e6)
            host_plan.append((t1 - t0) * 1e6)
        r["sync"] = "none raised"
    except RuntimeError as e:
        r["sync"] = f"raised: {e}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    r["wrapper_gpu_us"] = gpu_loop_us(step, steps)
    r["host_us"] = statistics.median(host) if host else math.nan
    r["host_plan_us"] = statistics.median(host_plan) if host_plan else math.nan
    r["builds_after"], r["allocs_after"] = w.builds - b0, allocations(dev) - a0

    # CUDA graph of run, one per bucket, replayed after each step's plan.
    eager = [step(s).clone() for s in range(steps)]
    graphs: dict[Any, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    same = True
    replays = []
    for s in range(steps):
        _, _, (ptr, idx, lens) = loop.tables[s]
        w.plan(loop.qo, ptr, idx, lens, check=False)
        if w.bucket not in graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                w.run(loop.q, loop.cache)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                o = w.run(loop.q, loop.cache)
            graphs[w.bucket] = (g, o)
        g, o = graphs[w.bucket]
        g.replay()
        replays.append(o.clone())
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(eager, replays))
    r["graph_equal"] = same

    def gstep(s: int) -> None:
        _, _, (ptr, idx, lens) = loop.tables[s]
        w.plan(loop.qo, ptr, idx, lens, check=False)
        graphs[w.bucket][0].replay()

    r["graph_gpu_us"] = gpu_loop_us(gstep, steps)

    # custom_kernel on the task tuples (no kv_lens).
    from mla_tune.buckets import router_for

    router = router_for(disp)
    custom_kernel(loop.tasks[0])
    for t in loop.tasks:
        custom_kernel(t)
    torch.cuda.synchronize()
    cb0, ca0 = router.builds, allocations(dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in loop.tasks:
            custom_kernel(t)
        r["task_sync"] = "none raised"
    except RuntimeError as e:
        r["task_sync"] = f"raised: {e}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    r["task_gpu_us"] = gpu_loop_us(lambda s: custom_kernel(loop.tasks[s]), steps)
    r["task_builds_after"], r["task_allocs_after"] = router.builds - cb0, \
        allocations(dev) - ca0
    task_decision = next(reversed(router._task.values())).runner.decision
    last = loop.tasks[-1]
    ref = mla_decode_reference(*last, kv_format=loop.fmt)
    r["task_err"] = float((custom_kernel(last).float() - ref).abs().max())

    # The same tokens as a uniform batch, through custom_kernel (exact or nearest winner).
    mean = loop.mean_len()
    ushape = Shape.uniform(loop.batch, mean)
    rows = ushape.total_kv
    kv_u = loop.flat[:rows] if loop.fmt == "bf16" else (loop.flat[:rows], loop.cache[1])
    utask = (loop.q, {loop.fmt: kv_u}, loop.qo,
             torch.arange(loop.batch + 1, dtype=torch.int32, device=dev) * mean,
             ushape.task_config())
    custom_kernel(utask)
    r["uniform_shape"] = f"{loop.batch}x{mean}"
    r["uniform_gpu_us"] = gpu_loop_us(lambda s: custom_kernel(utask), steps)
    # The bucket's own runner on those uniform lengths: what raggedness alone costs.
    router.run_task(utask)
    r["uniform_bucket_us"] = gpu_loop_us(lambda s: router.run_task(utask), steps)

    # The task path's runner at other split counts (a runtime knob: no recompile).
    from dataclasses import replace

    from mla_tune.buckets import build_runner
    base = task_decision
    splits = {}
    kv_max = [t[4]["kv_seq_len"] for t in loop.tasks]
    for n in (2, 4, 8, 16, 32):
        dec = replace(base, config=dict(base.config, num_splits=n))
        try:
            br = build_runner(dec, dec.shape, dev, paged=False)
        except Exception as e:  # noqa: BLE001
            splits[n] = f"{type(e).__name__}"
            continue

        def call(s: int, br=br) -> None:
            q, kvd, qo, kvp, _ = loop.tasks[s]
            e = kvd[loop.fmt]
            kv, sc = (e, None) if loop.fmt == "bf16" else e
            br(q, kv, sc, None, qo, kvp, kv_max[s])

        call(0)
        splits[n] = round(gpu_loop_us(call, steps), 1)
    r["task_splits"] = f"tuned {base.config['num_splits']}: " + ", ".join(
        f"{n}->{v}" for n, v in splits.items())

    # FlashInfer, plan + run each step on the same pool and tables.
    r["fi_us"] = r["fi_run_us"] = math.nan
    r["fi_note"] = ""
    if fi_ok:
        try:
            r.update(flashinfer_loop(loop))
        except Exception as e:  # noqa: BLE001 - the baseline failing is a result
            r["fi_note"] = f"{type(e).__name__}: {str(e)[:160]}"
    return r


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
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    disps = {f: Dispatcher.from_db(args.db, dev, kv_format=f, check_inputs=False)
             for f in args.formats.split(",")}
    print(f"# {next(iter(disps.values())).summary()}")
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")

    fi_ok = not args.no_flashinfer
    if fi_ok:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:  # noqa: BLE001
            print(f"# FlashInfer unavailable: {e}")
            fi_ok = False
    cols = ["batch", "fmt", "page", "wrapper us/step", "graph us/step", "task us/step",
            "uniform us (shape)", "bucket runner uniform us", "ratio",
            "FlashInfer plan+run us/step", "FI run-only us",
            "host plan / plan+run us", "builds/allocs after 1st", "task builds/allocs", "sync",
            "graph==eager", "max err wrapper / task"]
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
                    r = run_loop(loop, disps[fmt], disps[fmt].run, fi_ok)
                except Exception:  # noqa: BLE001 - report and go on with the next loop
                    torch.cuda.set_sync_debug_mode("default")
                    print(f"# {batch} {fmt} p{page} failed:\n" + traceback.format_exc()[-1500:],
                          flush=True)
                    continue
                ratio = min(r["wrapper_gpu_us"], r["task_gpu_us"]) / r["uniform_gpu_us"]
                print(f"| {batch} | {fmt} | {page} | {r['wrapper_gpu_us']:.1f} | "
                      f"{r['graph_gpu_us']:.1f} | {r['task_gpu_us']:.1f} | "
                      f"{r['uniform_gpu_us']:.1f} ({r['uniform_shape']}) | "
                      f"{r['uniform_bucket_us']:.1f} | "
                      f"{r['wrapper_gpu_us'] / r['uniform_gpu_us']:.2f} | "
                      f"{r['fi_us']:.1f} | {r['fi_run_us']:.1f} | "
                      f"{r['host_plan_us']:.1f} / {r['host_us']:.1f} | "
                      f"{r['builds_after']}/{r['allocs_after']} | "
                      f"{r['task_builds_after']}/{r['task_allocs_after']} | "
                      f"{'ok' if r['sync'] == r['task_sync'] == 'none raised' else 'RAISED'} | "
                      f"{r['graph_equal']} | {r['max_err']:.4f} / {r['task_err']:.4f} |", flush=True)
                notes.append(f"# {batch} {fmt} p{page}: buckets {r['buckets']}; "
                             f"{r['decision']}; sync {r['sync']} / {r['task_sync']}; "
                             f"FlashInfer {r.get('fi_backend', '')} {r['fi_note']}; "
                             f"task path split counts (us/step) {r['task_splits']}; "
                             f"best ratio {ratio:.2f}; {time.time() - t0:.0f} s")
                del loop
                torch.cuda.empty_cache()
    for n in notes:
        print(n)


if __name__ == "__main__":
    main()
