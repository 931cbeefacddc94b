"""bench/descriptor_cost.py compares read_floor's reader with a copy that builds its own TMA
descriptors: the copy must also build them in the kernel (tensormap writes in its PTX) and
pipeline its loads the same way, or the comparison times something else."""

from __future__ import annotations

import pytest

from tests.compiled_child import run_compiled

pytest.importorskip("triton")

_CHECK = r"""
import sys
sys.path.insert(0, "bench")
import torch
import descriptor_cost
from mla_tune.kernels.triton.precompile import jit_compile
k = jit_compile(descriptor_cost.read_tiles_own_desc, "cuda:90", (torch.uint8, torch.float32, 7),
                dict(W=576, BN=64, DA=512, DB=64, STAGES=3, num_warps=4, num_stages=3))
ptx = k.asm["ptx"]
print(k.metadata.shared // (64 * 576), "tensormap.replace" in ptx,
      ptx.count("cp.async.bulk.tensor") > 2)
"""


def test_reader_builds_its_descriptors_and_pipelines() -> None:
    proc = run_compiled(["-c", _CHECK], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2", "True", "True"]
