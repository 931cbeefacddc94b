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
import torch
from triton.tools.tensor_descriptor import TensorDescriptor
import read_floor
from mla_tune.kernels.triton.precompile import jit_compile
for dtype, bn, da, db in ((torch.uint8, 64, 512, 64), (torch.bfloat16, 32, 512, 64)):
    cache = torch.empty((1, da + db), dtype=dtype, device="meta")
    descs = [TensorDescriptor(cache, [1, da + db], [da + db, 1], [bn, w]) for w in (da, db)]
    for stages in (3, 4):
        k = jit_compile(read_floor.read_tiles, "cuda:90", (*descs, torch.float32, 7, 99),
                        dict(BN=bn, DA=da, DB=db, STAGES=stages, num_warps=4,
                             num_stages=stages))
        tile = bn * (da + db) * dtype.itemsize
        elem = "bf16" if dtype is torch.bfloat16 else "u8"
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


def test_the_committed_winner_column_reads_the_shipped_winners() -> None:
    import read_floor

    w = read_floor.committed_winner("fp8", 256, 8192)
    assert w is not None and w["backend"] == "triton" and w["median_us"] > 0
    # Shapes the Triton family does not win have no row to time.
    assert read_floor.committed_winner("bf16", 4, 1024) is None
