"""The distinct compiled kernels of the Triton family's default space (per-sequence splits,
and the balanced schedules length-bucket runners compile: over a contiguous cache and over
a page pool), and a command that cross-compiles all of them for NVIDIA sm_90 and AMD
gfx950 without a GPU (CI runs it through tests/kernels/test_static_check.py):

    python -m mla_tune.tuning.triton_variants [--jobs N]

One JSON line per (variant, target) report; exit status 1 if any variant fails to compile.
The enumeration lives here, not in kernels/, since it needs the backend's space and
feasibility rules: kernels/ never imports mla_tune.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from mla_tune.backends.triton_family import TritonFamily, kernel_config
from mla_tune.kernels.triton import mla_decode as md
from mla_tune.kernels.triton import static_check
from mla_tune.problem.shapes import KVFormat, Shape
from mla_tune.tuning.space import load_backend_space


def _configs(shape_of: Callable[[KVFormat], Shape], **fixed: Any
             ) -> Iterator[md.KernelConfig]:
    """The kernel configs of the declared default space's points feasible at
    `shape_of(format)`, every format, with the knobs in `fixed` set (duplicates included)."""
    fam = TritonFamily()
    for fmt in KVFormat:
        shape = shape_of(fmt)
        for point in load_backend_space("triton", "cuda").grid():
            point = dict(point, **fixed)
            if fam.feasible(shape, point):
                yield kernel_config(shape, point)


def default_variants() -> list[md.KernelConfig]:
    """Distinct compiled split kernels of the declared default space, over all formats.
    Runtime knobs (splits, fast mode, page size) are folded away."""
    # A shape on which every knob value is meaningful: 128 rows, long sequences, and one
    # query of whole tiles (kv_load='tma_host').
    seen: dict[tuple, md.KernelConfig] = {}
    for cfg in _configs(lambda f: Shape.uniform(1, 8192, heads=128, kv_format=f),
                        num_splits=1):
        seen.setdefault(static_check.variant_key(cfg), cfg)
    return list(seen.values())


def balanced_variants() -> list[tuple[md.KernelConfig, int]]:
    """Distinct compiled split kernels of the balanced schedules (SCHED_TOKENS, SCHED_PAGED)
    over the default space's points a ragged shape admits, as (config, schedule)."""
    # Ragged: balanced builds. The merge launch (pdl) leaves the split kernel as it is.
    seen: dict[tuple, tuple[md.KernelConfig, int]] = {}
    for cfg in _configs(lambda f: Shape(2, (8192, 8000), heads=128, kv_format=f),
                        num_splits=1, pdl=True):
        # Paged: pools of single-key pages (pointer loads) and of 64-key pages (TMA where
        # mla_decode.pool_tma says so; static_check.balanced_config).
        for c, sched in ((cfg, md.SCHED_TOKENS), (cfg, md.SCHED_PAGED),
                         (replace(cfg, page_size=64), md.SCHED_PAGED)):
            seen.setdefault(static_check.compiled_key(c, sched=sched), (c, sched))
    # Knobs only a pool of whole-tile pages admits (page_rows='tile').
    for cfg in _configs(lambda f: Shape(2, (8192, 8000), heads=128, kv_format=f, page_size=64),
                        num_splits=1, pdl=True):
        seen.setdefault(static_check.compiled_key(cfg, sched=md.SCHED_PAGED),
                        (cfg, md.SCHED_PAGED))
    # Chunked runs differ from runs along the stream in the program's prologue only (the
    # tile loop is the same code, compiled above for every knob): one per format, compute
    # path, row block, schedule, page form, load kind and fp8 conversion, which is what
    # the prologue meets, keeps CI's whole-space compile inside its time.
    out: dict[tuple, tuple[md.KernelConfig, int]] = {}
    for key, (cfg, sched) in seen.items():
        if cfg.bucket_runs == "chunks":
            form, flag, _ = static_check._launch_form(cfg, sched)
            key = ("chunks", cfg.kv_format, cfg.compute, cfg.block_m, sched, flag,
                   form.kv_load, cfg.fp8_convert)
        out.setdefault(key, (cfg, sched))
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    """Compile every default-space variant, per-sequence splits and balanced, for both
    targets; one JSON line per report. Exit status 1 if any variant fails to compile."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    failed = 0
    work = [*default_variants(), *balanced_variants()]
    for row in static_check.compile_all(work, jobs=a.jobs):
        failed += not row["report"]["ok"]
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
