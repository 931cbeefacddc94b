"""bench/kernel_phases.py patches clock probes into a copy of the kernel: every patch point
must still exist, and the probed kernel must compile for sm_90 with all seven probes (so a
kernel edit that moves one is caught here, not on the GPU)."""

from __future__ import annotations

import pytest

from tests.compiled_child import run_compiled

pytest.importorskip("triton")

_CHECK = r"""
import sys
sys.path.insert(0, "bench")
import kernel_phases
from mla_tune.kernels.triton.precompile import jit_compile
md = kernel_phases.probed_module()
for fmt, compute in (("bf16", "bf16"), ("fp8", "fp8qk")):
    cfg = md.KernelConfig(kv_format=fmt, compute=compute, block_n=64, num_stages=2)
    fn, args, kw = md.kernel_launches(cfg, heads=16, paged=False, merge=False,
                                      target="cuda:90")[0]
    print(fmt, jit_compile(fn, "cuda:90", args, kw).asm["ptx"].count("%clock64"))
"""


def test_probed_kernel_compiles_with_every_probe() -> None:
    proc = run_compiled(["-c", _CHECK], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["bf16", "7", "fp8", "7"]
