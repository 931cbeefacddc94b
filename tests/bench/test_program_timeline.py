"""bench/program_timeline.py patches timer probes into a copy of the kernel: every patch point
must still exist, and the probed kernel must compile for sm_90 with its four %globaltimer
reads (so a kernel edit that moves one is caught here, not on the GPU)."""

from __future__ import annotations

import pytest

from tests.compiled_child import run_compiled

pytest.importorskip("triton")

_CHECK = r"""
import sys
sys.path.insert(0, "bench")
import program_timeline
from mla_tune.kernels.triton.precompile import jit_compile
md = program_timeline.probed_module()
for fmt, compute, load in (("bf16", "bf16", "tma"), ("fp8", "fp8", "tma"),
                           ("fp8", "fp8qk", "pointer")):
    cfg = md.KernelConfig(kv_format=fmt, compute=compute, block_n=64, num_stages=2,
                          kv_load=load)
    fn, args, kw = md.kernel_launches(cfg, heads=16, paged=False, merge=False,
                                      target="cuda:90")[0]
    ptx = jit_compile(fn, "cuda:90", args, kw).asm["ptx"]
    print(compute, ptx.count("%globaltimer"), ptx.count("%smid"))
"""


def test_probed_kernel_compiles_with_every_probe() -> None:
    proc = run_compiled(["-c", _CHECK], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["bf16", "4", "1", "fp8", "4", "1", "fp8qk", "4", "1"]
