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

from mla_tune.backends.triton_family import TritonFamily, kernel_config
from mla_tune.kernels.triton import mla_decode as md
from mla_tune.kernels.triton import static_check
from mla_tune.problem.shapes import KVFormat, Shape
from mla_tune.tuning.space import load_backend_space


def default_variants() -> list[md.KernelConfig]:
    """Distinct compiled split kernels of the declared default space, over all formats.
    Runtime knobs (splits, fast mode, page size) are folded away."""
    fam = TritonFamily()
    seen: dict[tuple, md.KernelConfig] = {}
    for fmt in KVFormat:
        # A shape on which every knob value is meaningful: 128 rows, long sequences, and
        # one query of whole tiles (kv_load='tma_host').
        shape = Shape.uniform(1, 8192, heads=128, kv_format=fmt)
        for point in load_backend_space("triton", "cuda").grid():
            point = dict(point, num_splits=1)
            if not fam.feasible(shape, point):
                continue
            cfg = kernel_config(shape, point)
            seen.setdefault(static_check.variant_key(cfg), cfg)
    return list(seen.values())


def balanced_variants() -> list[tuple[md.KernelConfig, int]]:
    """Distinct compiled split kernels of the balanced schedules (SCHED_TOKENS, SCHED_PAGED)
    over the default space's points a ragged shape admits, as (config, schedule)."""
    fam = TritonFamily()
    seen: dict[tuple, tuple[md.KernelConfig, int]] = {}
    for fmt in KVFormat:
        shape = Shape(2, (8192, 8000), heads=128, kv_format=fmt)  # ragged: balanced builds
        for point in load_backend_space("triton", "cuda").grid():
            # The merge launch (pdl) leaves the split kernel as it is.
            point = dict(point, num_splits=1, pdl=True)
            if not fam.feasible(shape, point):
                continue
            cfg = kernel_config(shape, point)
            for sched in (md.SCHED_TOKENS, md.SCHED_PAGED):
                seen.setdefault(static_check.compiled_key(cfg, sched=sched), (cfg, sched))
    return list(seen.values())


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
