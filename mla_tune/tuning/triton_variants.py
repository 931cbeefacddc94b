"""The distinct compiled kernels of the Triton family's default space, and a command that
cross-compiles all of them for NVIDIA sm_90 and AMD gfx950 without a GPU (CI runs it
through tests/kernels/test_static_check.py):

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


def main(argv: list[str] | None = None) -> int:
    """Compile every default-space variant for both targets; one JSON line per report.
    Exit status 1 if any variant fails to compile."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    failed = 0
    for row in static_check.compile_all(default_variants(), jobs=a.jobs):
        failed += not row["report"]["ok"]
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
