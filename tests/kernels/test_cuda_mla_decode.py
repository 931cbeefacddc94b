"""The CUDA MLA decode kernel (kernels/cuda/mla_decode.cu): it compiles straight with nvcc
for sm_90a, with no torch or mla-tune in the build, and on an NVIDIA GPU every format's
variants match the float32 reference on ragged q_len 1 and 4 batches."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from mla_tune.backends.compiled_toolchain import find_compiler, parse_ptxas

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "cuda" / "mla_decode.cu"
NVCC = find_compiler("cuda")


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed (pip install nvidia-cuda-nvcc)")
@pytest.mark.parametrize("fmt", [0, 1, 2])
def test_compiles_straight_with_nvcc(tmp_path: Path, fmt: int) -> None:
    out = tmp_path / "k.cubin"
    res = subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-O3", "-Xptxas", "-v",
                          f"-DKV_FORMAT={fmt}", "-DBN=64", "-DNW=4", "-DPIPE=1",
                          "-o", str(out), str(SOURCE)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    regs, spills, _ = parse_ptxas(res.stdout + res.stderr)
    assert set(regs) == {"mla_split", "mla_merge"} and out.stat().st_size > 0
    assert spills["mla_split"] == 0


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_missing_knob_is_a_compile_error(tmp_path: Path) -> None:
    res = subprocess.run([NVCC, "-cubin", "-arch=sm_90a", "-DKV_FORMAT=0", "-DBN=64",
                          "-DNW=4", "-o", str(tmp_path / "k.cubin"), str(SOURCE)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "define PIPE" in res.stderr


@pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                    reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("q_len, heads", [(1, 16), (4, 128)])
def test_matches_reference_on_gpu(fmt: str, q_len: int, heads: int) -> None:
    from mla_tune.backends import get_backend
    from mla_tune.problem.reference import mla_decode_reference
    from mla_tune.problem.shapes import Shape, generate_input
    from mla_tune.problem.verify import check, tolerance_for

    b = get_backend("cuda")
    shape = Shape(4, (5, 64, 300, 1027), q_len, heads, fmt)
    data = generate_input(shape, seed=2, device="cuda")
    ref = mla_decode_reference(*data, kv_format=fmt)
    for config in b.candidates(shape, "cuda"):
        if b.precheck(shape, config, "cuda"):
            continue
        res = check(b.build(shape, config, "cuda")(data), ref, tolerance_for(fmt))
        assert res.ok, (config, res.reason)
