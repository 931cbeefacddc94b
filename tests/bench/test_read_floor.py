"""bench/read_floor.py's reader must stream like the MLA kernel does: its TMA tile loads
software-pipelined, the shared-memory ring growing with the pipeline depth. Unpipelined (as
Triton leaves a plain range() loop whose loads feed no dot), it would time load latency,
not the read floor."""

from __future__ import annotations

import pytest

from tests.compiled_child import run_compiled

pytest.importorskip("triton")

_CHECK = r"""
import sys
sys.path.insert(0, "bench")
import triton
from triton.backends.compiler import GPUTarget
import read_floor
for elem, bn, da, db in (("u8", 64, 512, 64), ("bf16", 32, 512, 64)):
    for stages in (3, 4):
        sig = {"desc_a": f"tensordesc<{elem}[{bn}, {da}]>",
               "desc_b": f"tensordesc<{elem}[{bn}, {db}]>", "OUT": "*fp32",
               "tiles_per_prog": "i32", "total_tiles": "i32", "BN": "constexpr",
               "DA": "constexpr", "DB": "constexpr", "STAGES": "constexpr"}
        src = triton.compiler.ASTSource(
            fn=read_floor.read_tiles, signature=sig,
            constexprs={"BN": bn, "DA": da, "DB": db, "STAGES": stages})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": stages})
        tile = bn * (da + db) * (2 if elem == "bf16" else 1)
        print(elem, stages, k.metadata.shared // tile, k.asm["ptx"].count("cp.async.bulk.tensor"))
"""


def test_reader_pipelines_its_tma_loads() -> None:
    proc = run_compiled(["-c", _CHECK], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert [(r[0], r[1]) for r in rows] == [("u8", "3"), ("u8", "4"), ("bf16", "3"),
                                           ("bf16", "4")]
    for _, stages, buffers, copies in rows:
        assert int(buffers) == int(stages) - 1  # tiles in flight: the ring
        assert int(copies) > 2  # prologue copies besides the loop's own
