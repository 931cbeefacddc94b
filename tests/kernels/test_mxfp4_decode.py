"""The MXFP4 decode of the Triton family: on NVIDIA it is PTX inline assembly (prmt, lop3,
bf16x2 multiplies), elsewhere integer arithmetic (covered by the interpreter cases). Both
must give exactly e2m1 * 2**(byte - 127) in bf16, for every byte and every scale byte the
format can hold without overflow."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mla_tune.kernels.triton import mla_decode as md  # noqa: E402

ROWS = 16
SCALES = [0, 1, 2, 60, 100, 120, 126, 127, 128, 129, 150, 200, 251, 252]


@triton.jit
def _decode_probe(P, S, LO, HI, R: tl.constexpr, NV_ASM: tl.constexpr):
    r = tl.arange(0, R)
    blk = tl.arange(0, 16)
    byte = tl.arange(0, 16)
    idx = r[:, None, None] * 256 + blk[None, :, None] * 16 + byte[None, None, :]
    packed = tl.load(P + idx)
    scale = tl.load(S + r[:, None] * 16 + blk[None, :])
    lo, hi = md._decode_e2m1(packed, scale, NV_ASM)
    tl.store(LO + idx, lo)
    tl.store(HI + idx, hi)


def test_nvidia_decode_is_inline_ptx_and_amd_compiles_without_it() -> None:
    import torch

    from mla_tune.kernels.triton.precompile import jit_compile

    args = (torch.uint8, torch.uint8, torch.bfloat16, torch.bfloat16)
    nv = jit_compile(_decode_probe, "cuda:90", args, dict(R=ROWS, NV_ASM=True))
    assert "mul.rn.bf16x2" in nv.asm["ptx"] and "prmt.b32" in nv.asm["ptx"]
    amd = jit_compile(_decode_probe, "hip:gfx950", args, dict(R=ROWS, NV_ASM=False))
    assert amd.asm["amdgcn"]


def _expected(packed, scales):
    """float64 e2m1 * 2**(s - 127) for the low and high nibble of every byte."""
    import torch

    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    p = packed.long()
    mult = torch.pow(2.0, scales.double() - 127).repeat_interleave(16, dim=1)

    def value(nib):
        v = e2m1[nib & 7]
        return torch.where(nib >= 8, -v, v)
    return value(p & 15) * mult, value(p >> 4) * mult


def test_gpu_decode_is_exact_for_every_byte_and_scale() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the PTX decode runs on an NVIDIA device")
    if torch.version.hip:
        pytest.skip("the PTX decode is NVIDIA's; AMD runs the arithmetic path")
    dev = torch.device("cuda")
    packed = torch.arange(256, dtype=torch.uint8).repeat(ROWS, 1)
    for start in range(0, len(SCALES), ROWS // 8):
        chunk = (SCALES[start:start + ROWS // 8] * 8)[:ROWS]
        scales = torch.tensor(chunk, dtype=torch.uint8)[:, None].repeat(1, 16)
        lo = torch.empty((ROWS, 256), dtype=torch.bfloat16, device=dev)
        hi = torch.empty_like(lo)
        _decode_probe[(1,)](packed.to(dev), scales.to(dev), lo, hi, R=ROWS, NV_ASM=True)
        want_lo, want_hi = _expected(packed, scales)
        assert torch.equal(lo.cpu().double(), want_lo), chunk
        assert torch.equal(hi.cpu().double(), want_hi), chunk
