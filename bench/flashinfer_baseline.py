"""FlashInfer MLA decode baseline: a grid of FlashInfer variants, each verified against the
float32 reference and timed with the cold-L2 timer the tuner uses (mla_tune.tuning.timing).

Run on the GPU machine after `source .device/setup.sh`:
    python3 bench/flashinfer_baseline.py --precompile        # JIT every module, in parallel
    python3 bench/flashinfer_baseline.py --out results.md    # verify + time, markdown out
FlashInfer compiles one module per (backend, KV dtype) on first use (about 22 s each);
`--precompile` builds them concurrently in subprocesses so the sweep itself times no JIT.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import benchkit
from mla_tune.backends.flashinfer_backend import FlashInferBackend
from mla_tune.problem.shapes import KVFormat, Shape
from mla_tune.problem.verify import tolerance_for
from mla_tune.tuning.evaluate import TrialOutcome, evaluate
from mla_tune.tuning.timing import TimingPolicy, make_timer

POLICY = TimingPolicy(warmup=3, min_runs=20, max_runs=200, target_rse=0.005, budget_s=0.15)


@dataclass(frozen=True)
class Row:
    shape: Shape
    config: dict[str, object]
    outcome: TrialOutcome


def variants(fmt: KVFormat, backends: list[str], pages: list[int], launches: list[str],
             scales: list[str]) -> list[dict[str, object]]:
    """Grid points to time; fp8_scale only varies for fp8 KV."""
    fp8_scales = scales if fmt is KVFormat.FP8 else ["host"]
    return [{"backend": b, "page_size": p, "launch": lch, "fp8_scale": s}
            for b, p, lch, s in itertools.product(backends, pages, launches, fp8_scales)]


def compile_one(backend: str, fmt: str) -> None:
    """Build one small variant: compiles (or loads) the module of (backend, KV dtype)."""
    t0 = time.perf_counter()
    shape = Shape.uniform(2, 64, kv_format=fmt)
    config = {"backend": backend, "page_size": 1, "launch": "wrapper", "fp8_scale": "host"}
    FlashInferBackend().build(shape, config, torch.device("cuda"))
    print(f"compiled {backend} {fmt} in {time.perf_counter() - t0:.1f} s", flush=True)


def precompile(backends: list[str], formats: list[str]) -> None:
    """Compile every (backend, format) module at once, one subprocess each."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-one", b, f])
             for b in backends for f in formats]
    codes = [p.wait() for p in procs]
    print(f"precompile: exit codes {codes}, {time.perf_counter() - t0:.1f} s wall", flush=True)


def _fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _config_label(config: dict[str, object], fmt: KVFormat) -> str:
    label = f"{config['backend']} p{config['page_size']} {config['launch']}"
    return label + (f" {config['fp8_scale']}" if fmt is KVFormat.FP8 else "")


def render(rows: list[Row], header: str) -> str:
    """Markdown: best variant per shape and format, then every trial."""
    lines = [header, "", "## Best variant per shape (median us, cold L2)", "",
             "| shape | format | best median us | variant | GB/s | max abs err |",
             "| --- | --- | --- | --- | --- | --- |"]
    best: dict[tuple[str, str], Row] = {}
    for r in rows:
        st = r.outcome.stats
        if r.outcome.status != "ok" or st is None:
            continue
        key = (r.shape.label(), r.shape.kv_format.value)
        if key not in best or st.median_us < best[key].outcome.stats.median_us:
            best[key] = r
    geo: dict[str, list[float]] = {}
    for (label, fmt), r in best.items():
        st = r.outcome.stats
        gbs = r.shape.kv_bytes / (st.median_us * 1e3)
        lines.append(f"| {label} | {fmt} | {st.median_us:.1f} | "
                     f"{_config_label(r.config, r.shape.kv_format)} | {gbs:.0f} | "
                     f"{r.outcome.max_abs_err:.2e} |")
        geo.setdefault(fmt, []).append(st.median_us)
    for fmt, values in geo.items():
        gm = math.exp(sum(math.log(v) for v in values) / len(values))
        lines.append(f"| geomean ({len(values)} shapes) | {fmt} | {gm:.1f} | | | |")
    lines += ["", "## Every trial", "",
              "| shape | format | variant | status | median us | min us | std us | n | "
              "max abs err | mismatch | error |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        o, st = r.outcome, r.outcome.stats
        err = (o.error or "").replace("|", "/").replace("\n", " ")[:160]
        lines.append(
            f"| {r.shape.label()} | {r.shape.kv_format.value} | "
            f"{_config_label(r.config, r.shape.kv_format)} | {o.status} | "
            f"{_fmt_us(st.median_us if st else None)} | {_fmt_us(st.min_us if st else None)} | "
            f"{_fmt_us(st.std_us if st else None)} | {st.n if st else '-'} | "
            f"{'-' if o.max_abs_err is None else f'{o.max_abs_err:.2e}'} | "
            f"{'-' if o.mismatch_frac is None else f'{o.mismatch_frac:.1e}'} | {err} |")
    return "\n".join(lines) + "\n"


def sweep(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    backend = FlashInferBackend()
    av = backend.available(dev)
    if not av:
        sys.exit(f"FlashInfer unavailable: {av.reason}")
    timer = make_timer(dev, POLICY)
    props = torch.cuda.get_device_properties(dev)
    header = "\n".join([
        f"# FlashInfer MLA decode baseline ({datetime.date.today().isoformat()})", "",
        f"- device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
        f"flashinfer {backend.versions().get('flashinfer', '?')}",
        f"- command: `{' '.join([Path(sys.executable).name] + sys.argv)}`",
        f"- timer: mla_tune.tuning.timing CudaTimer (L2 flushed before every call, CUDA events), "
        f"{POLICY}", "- heads 16, q_len 1; every variant verified against "
        "mla_tune.problem.reference before timing (tolerance from configs/tolerances.toml)"])
    out = Path(args.out)
    rows: list[Row] = []
    # Shape by shape, both formats each, so that a run cut short still has whole shapes.
    for kv_len, batch in itertools.product(args.kvs, args.batches):
        data = benchkit.task_input(Shape.uniform(batch, kv_len), dev)
        for fmt in map(KVFormat, args.formats):
            shape = Shape.uniform(batch, kv_len, kv_format=fmt)
            ref = benchkit.reference(data, fmt)
            for config in variants(fmt, args.backends, args.pages, args.launches, args.scales):
                outcome = evaluate(backend, shape, config, dev, data, ref, tolerance_for(fmt),
                                   timer)
                rows.append(Row(shape, config, outcome))
                st = outcome.stats
                print(f"{shape.label():24s} {_config_label(config, fmt):26s} {outcome.status:6s} "
                      f"{_fmt_us(st.median_us if st else None):>8s} {outcome.error or ''}",
                      flush=True)
            del ref
            out.write_text(render(rows, header))
        del data
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precompile", action="store_true", help="only JIT-compile the modules")
    p.add_argument("--compile-one", nargs=2, metavar=("BACKEND", "FORMAT"),
                   help=argparse.SUPPRESS)
    p.add_argument("--out", default="flashinfer_baseline.md", help="markdown results file")
    p.add_argument("--batches", type=int, nargs="+", default=[4, 32, 64, 128, 256])
    p.add_argument("--kvs", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--backends", nargs="+", default=["fa3", "fa2"])
    p.add_argument("--pages", type=int, nargs="+", default=[1, 64])
    p.add_argument("--launches", nargs="+", default=["wrapper", "direct"])
    p.add_argument("--scales", nargs="+", default=["host", "fold"])
    args = p.parse_args()
    if args.compile_one:
        compile_one(*args.compile_one)
    elif args.precompile:
        precompile(args.backends, args.formats)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
