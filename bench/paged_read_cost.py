"""What reading a serving batch through a page table costs the balanced runner.

For one loop of bench/serving_loop.py (batch, KV format; the shipped DB's bucket winner,
as the task path runs it), the same compiled config and program count timed over the
same steps' lengths in each of these layouts of the same tokens:
- `tokens tma` / `tokens pointer`: a contiguous ragged cache (SCHED_TOKENS), TMA tiles or
  pointer loads;
- `paged P ordered`: FlashInfer's paged metadata (SCHED_PAGED, pointer loads through the
  page indices) with each sequence's pages consecutive in the pool;
- `paged P shuffled`: the same with the pages at shuffled positions (serving_loop's pools),
  through pointer loads and, where `mla_decode.pool_tma` admits the config, through TMA;
  and, for pages of at least a tile, through pointer loads with one page index per tile
  (`paged P shuffled tile`: the `page_rows='tile'` form, mla_decode.paged_tiles).
The paged layouts' pools hold NaN in every slot no sequence holds, so a runner that lets
a slot past a sequence's end reach the output fails the error check.
So the gap between the contiguous and the paged runner splits into the load method, the
indirection and the placement. GPU time per step over the loop (CUDA events), median of
three loops; every layout's last step is checked against the float32 reference.

    python3 bench/paged_read_cost.py --batch 128 --format fp8
    # one layout's steps only (for ncu --launch-skip/--launch-count):
    python3 bench/paged_read_cost.py --batch 128 --format fp8 --only "paged 64 shuffled tma"
    # a given config instead of the DB's winner (any GPU), two layouts only, each also
    # with the kernel an edit replaces, right after it:
    git show HEAD:kernels/triton/mla_decode.py > /tmp/base.py
    python3 bench/paged_read_cost.py --batch 128 --format fp8 --pages 64 \
        --config block_n=64,num_stages=3,fast_mode=1,kv_load=tma --programs 264 --seg-cost 8 \
        --layouts "tokens tma,paged 64 shuffled tma" --baseline /tmp/base.py
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import benchkit  # refuses to run against another checkout
from mla_tune.kernels.triton import mla_decode as md
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import QK_HEAD_DIM, SM_SCALE
from mla_tune.runtime.dispatcher import Dispatcher
from mla_tune.runtime.wrapper import MLADecodeWrapper
from serving_loop import Loop, _cumsum, gpu_loop_us, reference


def ordered_pages(loop: Loop) -> list[list[int]]:
    """Per sequence its pages (for the final step), consecutive in the pool."""
    n_pages = [-(-(L + loop.steps) // loop.page) for L in loop.lens0]
    first = [0] + _cumsum(n_pages)
    return [list(range(first[b], first[b] + n)) for b, n in enumerate(n_pages)]


def poisoned_pool(loop: Loop, pages: list[list[int]]) -> Any:
    """`loop`'s pool (as `run` takes it) with NaN in every slot that no step's sequence
    holds, sequence b's pages being `pages[b]`: the tails of last pages, the other pages.
    A runner that lets them reach the output (0 * NaN) fails the error check."""
    flat = loop.flat.clone().view(-1, QK_HEAD_DIM)
    used = torch.zeros(flat.shape[0], dtype=torch.bool)
    for b, pg in enumerate(pages):
        rows = (torch.tensor(pg)[:, None] * loop.page + torch.arange(loop.page)).reshape(-1)
        used[rows[:loop.lens0[b] + loop.steps]] = True
    bad = (~used).to(flat.device)
    if loop.fmt == "bf16":
        flat[bad] = float("nan")
        return flat.view(-1, loop.page, QK_HEAD_DIM)
    flat.view(torch.uint8)[bad] = 0x7F  # e4m3fn NaN
    return flat.view(-1, loop.page, QK_HEAD_DIM), loop.cache[1]


def task_launcher(loop: Loop, disp: Dispatcher) -> md.BalancedLauncher:
    """The balanced launcher the task path runs for this loop (its bucket winner)."""
    from mla_tune.runtime.buckets import router_for

    router = router_for(disp)
    disp.run(loop.tasks[0])
    runner = next(reversed(router._task.values())).runner
    launcher = getattr(runner, "launcher", None)
    if launcher is None and loop.dev.type != "cuda":
        # No GPU: the winners are not this machine's; a small config exercises the script.
        compute = "fp8" if loop.fmt == "fp8" else "bf16"
        cfg = md.KernelConfig(kv_format=loop.fmt, compute=compute, block_n=32,
                              num_splits=1, fast_mode=True, kv_load="tma")
        launcher = md.BalancedLauncher(cfg, heads=16, q_len=1, batch=loop.batch,
                                       device=loop.dev, sched=md.SCHED_TOKENS,
                                       sm_scale=SM_SCALE)
    if launcher is None:
        raise SystemExit(f"the task path runs {runner.decision.describe()}, not a balanced "
                         "launcher: nothing to compare")
    return launcher


def given_launcher(knobs: str, fmt: str, batch: int, programs: int, seg_cost: int,
                   dev: torch.device) -> md.BalancedLauncher:
    """A contiguous-cache balanced launcher of the config `knobs` ('field=value,...'; the
    compute path follows the format unless given)."""
    cfg = benchkit.kernel_config(knobs, fmt, where="--config", num_splits=1,
                                 compute="fp8" if fmt == "fp8" else "bf16")
    L = md.BalancedLauncher(cfg, heads=16, q_len=1, batch=batch, device=dev,
                            sched=md.SCHED_TOKENS, sm_scale=SM_SCALE, programs=programs,
                            seg_cost=seg_cost)
    L.prepare()
    return L


def build(kernel: ModuleType, base: md.BalancedLauncher, cfg: md.KernelConfig, loop: Loop,
          sched: int, page: int) -> Any:
    """A launcher of `cfg` from kernel module `kernel` with `base`'s program count, setup
    charge and merge mode."""
    L = kernel.BalancedLauncher(benchkit.config_in(kernel, cfg), heads=16, q_len=1,
                                batch=loop.batch, device=loop.dev, sched=sched,
                                page_size=page, sm_scale=SM_SCALE, programs=base.programs,
                                merge=base.merge, seg_cost=base.seg_cost)
    L.prepare()
    return L


def layouts(loop: Loop, loops: dict[int, Loop], base: md.BalancedLauncher,
            wanted: set[str] | None = None, kernel: ModuleType = md
            ) -> dict[str, tuple[Any, Any]]:
    """name -> (fn(step) launching that layout's runner, the float32 reference of the
    last step), for the layouts named in `wanted` (all when None; the others are not
    built), with the kernels of module `kernel` (the checkout's, or a baseline version)."""
    fmt = loop.fmt
    scale = None if fmt == "bf16" else loop.cache[1]
    out: dict[str, Any] = {}
    cfgs = {"tma": replace(base.cfg, kv_load="tma"),
            "pointer": replace(base.cfg, kv_load="pointer")}
    for name, cfg in cfgs.items():
        if wanted is not None and f"tokens {name}" not in wanted:
            continue
        T = build(kernel, base, cfg, loop, kernel.SCHED_TOKENS, 1)

        def tokens(s: int, T: Any = T) -> torch.Tensor:
            q, kvd, qo, kvp, _ = loop.tasks[s]
            e = kvd[fmt]
            return T(q, e if fmt == "bf16" else e[0], scale, None, qo, kvp)

        out[f"tokens {name}"] = (tokens, mla_decode_reference(*loop.tasks[-1],
                                                               kv_format=fmt))
    for page, lp in loops.items():
        pscale = None if fmt == "bf16" else lp.cache[1]
        ordered, shuffled = ordered_pages(lp), lp.pages
        pointer = replace(base.cfg, kv_load="pointer", page_rows="key")
        runs = [("pointer", pointer, "ordered", ordered),
                ("pointer", pointer, "shuffled", shuffled)]
        if kernel.pool_tma(benchkit.config_in(kernel, base.cfg), page):
            runs.append(("tma", replace(base.cfg, kv_load="tma"), "shuffled", shuffled))
        if page >= base.cfg.block_n and hasattr(kernel, "paged_tiles"):
            runs.append(("tile", replace(pointer, page_rows="tile"), "shuffled", shuffled))
        pools = {"ordered": poisoned_pool(lp, ordered), "shuffled": poisoned_pool(lp, shuffled)}
        for label, cfg, order, pages in runs:
            if wanted is not None and f"paged {page} {order} {label}" not in wanted:
                continue
            P = build(kernel, base, cfg, lp, kernel.SCHED_PAGED, page)
            tables = [dev for _, _, dev in lp.page_tables(pages)]
            pool = pools[order] if fmt == "bf16" else pools[order][0]

            def paged(s: int, P: Any = P, tables: list = tables,
                      pool: torch.Tensor = pool, pscale: Any = pscale,
                      lp: Loop = lp) -> torch.Tensor:
                ptr, idx, lens = tables[s]
                return P(lp.q, pool, pscale, None, lp.qo, lens, ptr, idx)

            out[f"paged {page} {order} {label}"] = (
                paged, reference(lp, lp.steps - 1, pages))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--format", default="fp8")
    ap.add_argument("--pages", default="1,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--lo", type=int, default=300)
    ap.add_argument("--hi", type=int, default=8000)
    ap.add_argument("--db", default="shipped")
    ap.add_argument("--kv-load", choices=["pointer", "tma"],
                    help="the task launcher's loads instead of its winner's")
    ap.add_argument("--only", default="", help="run this layout's steps once, untimed (ncu)")
    ap.add_argument("--config", default="",
                    help="instead of the DB's bucket winner: KernelConfig fields "
                         "(e.g. 'block_n=64,num_stages=3,fast_mode=1,kv_load=tma'; compute "
                         "follows the format) run with --programs and --seg-cost; runs on "
                         "any GPU, the DB's winners only on the device they were tuned on")
    ap.add_argument("--programs", type=int, default=0, help="with --config (0: the default)")
    ap.add_argument("--seg-cost", type=int, default=md.SEG_COST, help="with --config")
    ap.add_argument("--baseline", type=Path,
                    help="also time each layout with the kernel source in this file (another "
                         "version of kernels/triton/mla_decode.py), right after the "
                         "checkout's, with the same config")
    ap.add_argument("--layouts", default="",
                    help="time only these layouts (comma-separated names, e.g. "
                         "'tokens tma,paged 64 shuffled tma'; 'wrapper' for the wrapper)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and a.batch > 8:
        sys.exit("no GPU: only a small --batch runs (under Triton's interpreter)")
    disp = Dispatcher.from_db(a.db, dev, kv_format=a.format, check_inputs=False)
    loops = {p: Loop(a.batch, a.format, p, a.steps, a.lo, a.hi, 0, dev)
             for p in (int(x) for x in a.pages.split(","))}
    first = next(iter(loops.values()))
    if a.config:
        base = given_launcher(a.config, a.format, a.batch, a.programs, a.seg_cost, dev)
    else:
        base = task_launcher(first, disp)
    if a.kv_load:
        base.cfg = replace(base.cfg, kv_load=a.kv_load)
    # The page-64 bucket's own winner, as the wrapper runs it, for scale.
    wanted = {x.strip() for x in a.layouts.split(",") if x.strip()} or None
    if a.only:
        wanted = {a.only}
    fns = layouts(first, loops, base, wanted)
    if a.baseline:
        old = layouts(first, loops, base, wanted, benchkit.load_kernel(a.baseline))
        both: dict[str, tuple[Any, Any]] = {}
        for name, fn in fns.items():
            both[name] = fn
            if name in old:
                both[f"{name} [baseline]"] = old[name]
        fns = both
    if 64 in loops and (wanted is None or "wrapper" in wanted
                        or "wrapper page 64 (its winner)" in wanted):
        w = MLADecodeWrapper(a.format, 16, 1, 64, dev, dispatcher=disp)
        lp = loops[64]

        pool64 = poisoned_pool(lp, lp.pages)

        def wrapper(s: int) -> torch.Tensor:
            _, _, (ptr, idx, lens) = lp.tables[s]
            w.plan(lp.qo, ptr, idx, lens, check=False)
            return w.run(lp.q, pool64)

        fns["wrapper page 64 (its winner)"] = (wrapper, reference(lp, lp.steps - 1))
    if a.only:
        fn = fns[a.only][0]
        for s in range(a.steps):
            fn(s)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return
    print(f"# {a.batch} x uniform:{a.lo}-{a.hi} {a.format}, {a.steps} steps; config "
          f"{base.cfg}, {base.programs} programs, seg_cost {base.seg_cost}, merge {base.merge}")
    print("| layout | µs per step | max abs error, last step |")
    print("|---|---|---|")
    for name, (fn, ref) in fns.items():
        fn(0)
        us = gpu_loop_us(fn, a.steps) if dev.type == "cuda" else float("nan")
        diff = float((fn(a.steps - 1).float() - ref).abs().max())
        print(f"| {name} | {us:.1f} | {diff:.4f} |", flush=True)


if __name__ == "__main__":
    main()
