"""bench/kernel_probe.py --baseline times a second version of the kernel source next to the
checkout's: that version must load as a module of its own (its own jit functions, so both
compile side by side), and a file that is not Python must be refused with a clear error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import kernel_probe  # noqa: E402

from kernels.triton import mla_decode  # noqa: E402
from kernels.triton.precompile import jit_compile  # noqa: E402


def test_baseline_kernel_loads_as_its_own_module_and_compiles(tmp_path: Path) -> None:
    base = tmp_path / "base_kernel.py"
    base.write_text((ROOT / "kernels" / "triton" / "mla_decode.py").read_text())
    md = kernel_probe.load_kernel(base)
    assert md is not mla_decode
    assert md.mla_decode_kernel is not mla_decode.mla_decode_kernel
    cfg = md.KernelConfig(kv_format="bf16", block_n=32, num_stages=2)
    fn, args, kwargs = md.kernel_launches(cfg, heads=16, paged=False, merge=False,
                                          target="cuda:90")[0]
    assert jit_compile(fn, "cuda:90", args, kwargs).asm["ptx"].count("mma") > 0


def test_a_baseline_that_is_not_python_is_refused(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a kernel")
    with pytest.raises(SystemExit, match="not a Python file"):
        kernel_probe.load_kernel(notes)
