"""fp8 and MXFP4 quantizers: hand-computed bytes, aiter's layout, and a bit-for-bit match
with a plain scalar implementation of the rule written from the spec."""

from __future__ import annotations

import math
import struct
from types import SimpleNamespace

import pytest
import torch

from mla_tune.problem import quant

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------- scalar model of the rule

def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def scalar_block_exponent(block: list[float]) -> int:
    amax = max(abs(v) for v in block)
    rounded = _bits_f32((_f32_bits(amax) + 0x200000) & 0xFF800000)
    if rounded == 0.0:
        e = -127
    else:
        mant, exp = math.frexp(rounded)   # rounded = mant * 2**exp, mant in [0.5, 1)
        e = (exp - 1) - 2                 # floor(log2(rounded)) - 2
    return max(-127, min(127, e))


def scalar_code(v: float, ties: str = "away") -> int:
    """Nearest E2M1 code of v (already scaled), by comparing distances."""
    a = abs(v)
    best = None
    for code, g in enumerate(GRID):
        d = abs(a - g)
        if best is None or d < best[0]:
            best = (d, code)
        elif d == best[0]:
            if ties == "away" or code % 2 == 0:   # the larger one, or the even mantissa
                best = (d, code)
    code = 7 if a >= 6.0 else best[1]
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def scalar_quantize_rows(rows: list[list[float]], ties: str = "away"
                         ) -> tuple[list[list[int]], list[list[int]]]:
    packed, scales = [], []
    for row in rows:
        codes, srow = [], []
        for b0 in range(0, len(row), 32):
            block = row[b0:b0 + 32]
            e = scalar_block_exponent(block)
            srow.append(e + 127)
            codes += [scalar_code(v * 2.0 ** -e, ties) for v in block]
        packed.append([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)])
        scales.append(srow)
    return packed, scales


def _rows_of(kv: torch.Tensor) -> list[list[float]]:
    return kv.float().reshape(-1, kv.shape[-1]).tolist()


def _one_block(values: list[float], d: int = 576) -> torch.Tensor:
    """A (1, 1, d) bf16 row whose first block holds `values`, the rest zero."""
    row = torch.zeros(1, 1, d)
    row[0, 0, :len(values)] = torch.tensor(values)
    return row.to(torch.bfloat16)


def _codes(kv_fp4: torch.Tensor) -> list[int]:
    b = kv_fp4.reshape(-1)
    return torch.stack((b & 0xF, b >> 4), -1).reshape(-1).tolist()


# ---------------------------------------------------------------- MXFP4: hand-computed

def test_e2m1_table() -> None:
    assert quant.E2M1_VALUES[:8] == GRID
    assert quant.E2M1_VALUES[8:] == tuple(-g for g in GRID)
    assert quant.E2M1_MAX == 6.0


def test_ties_go_away_from_zero_with_amax_6() -> None:
    # amax 6.0 = 1.5 * 2^2: the +0x200000 does not carry, e = 2 - 2 = 0, byte 127.
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, -5.0, 0.5, 3.0]
    fp4, scale = quant.quantize_mxfp4(_one_block(vals))
    assert scale[0, 0] == 127
    got = _codes(fp4)[:len(vals)]
    #          .25 .75 1.25 1.75 2.5 3.5 5.0 6.0 -.25 -2.5 -5.0 .5  3.0
    assert got == [1, 2, 3, 4, 5, 6, 7, 7, 9, 13, 15, 1, 5]


def test_ties_even_option() -> None:
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5]
    fp4, _ = quant.quantize_mxfp4(_one_block(vals), ties="even")
    assert _codes(fp4)[:len(vals)] == [0, 2, 2, 4, 4, 6, 6, 7, 8, 12]
    with pytest.raises(ValueError):
        quant.quantize_mxfp4(_one_block(vals), ties="up")


def test_amax_mantissa_175_rounds_scale_up() -> None:
    # 7.0 = 1.75 * 2^2: +0x200000 carries into the exponent -> 8.0, e = 1, byte 128.
    fp4, scale = quant.quantize_mxfp4(_one_block([7.0, 1.0, -3.0, 0.5]))
    assert scale[0, 0] == 128
    # 7/2 = 3.5 -> tie -> 4.0 (6); 1/2 = 0.5 (1); -3/2 = -1.5 (0xB); 0.5/2 = 0.25 -> 0.5 (1)
    assert _codes(fp4)[:4] == [6, 1, 0xB, 1]
    deq = quant.dequantize_mxfp4(fp4, scale)
    assert deq[0, 0, :4].tolist() == [8.0, 1.0, -3.0, 1.0]


def test_saturation_and_small_scales() -> None:
    # 6.5 = 1.625 * 2^2: no carry, e = 0, 6.5 saturates to 6.
    fp4, scale = quant.quantize_mxfp4(_one_block([6.5, -6.5, 0.1]))
    assert scale[0, 0] == 127
    assert _codes(fp4)[:3] == [7, 15, 0]
    # amax 1.0: e = -2 (byte 125), so 1.0 -> 4.0 and 0.03125 -> 0.125 -> 0.
    fp4, scale = quant.quantize_mxfp4(_one_block([1.0, 0.375, -0.03125]))
    assert scale[0, 0] == 125
    assert _codes(fp4)[:3] == [6, 3, 8]


def test_zero_block_negative_zero_and_signs() -> None:
    kv = _one_block([-0.0, 0.0, -1e-3])          # block 0: max 1e-3
    kv[0, 0, 32:64] = 0.0                          # block 1: all zero
    kv[0, 0, 64] = -0.0
    fp4, scale = quant.quantize_mxfp4(kv)
    assert scale[0, 1] == 0                        # e clamps to -127 -> byte 0
    assert scale[0, 2] == 0
    codes = _codes(fp4)
    assert codes[0] == 8 and codes[1] == 0         # -0 keeps its sign bit
    assert codes[64] == 8
    deq = quant.dequantize_mxfp4(fp4, scale)
    assert deq[0, 0, 32:64].abs().sum() == 0
    assert torch.signbit(deq[0, 0, 64])


def test_nibble_order() -> None:
    fp4, _ = quant.quantize_mxfp4(_one_block([6.0, -1.0, 0.5, 3.0]))
    assert fp4[0, 0, 0] == 0x7 | (0xA << 4)
    assert fp4[0, 0, 1] == 0x1 | (0x5 << 4)


# ---------------------------------------------------------------- MXFP4: layout

@pytest.mark.parametrize("n, scale_rows", [(1, 256), (5, 256), (256, 256), (257, 512)])
def test_layout_and_padding(n: int, scale_rows: int) -> None:
    kv = (torch.randn(n, 1, 576) * 3).to(torch.bfloat16)
    fp4, scale = quant.quantize_mxfp4(kv)
    assert fp4.shape == (n, 1, 288) and fp4.dtype == torch.uint8
    assert scale.shape == (scale_rows, 24) and scale.dtype == torch.uint8
    assert scale.is_contiguous() and scale.stride() == (24, 1)
    assert (scale[:n, :18] > 100).all()            # real scales of randn*3 data
    assert (scale[:n, 18:] == quant.SCALE_PAD_BYTE).all()
    assert (scale[n:] == quant.SCALE_PAD_BYTE).all()


def test_leading_shape_does_not_matter() -> None:
    kv = torch.randn(7, 1, 576).to(torch.bfloat16)
    a, sa = quant.quantize_mxfp4(kv)
    b, sb = quant.quantize_mxfp4(kv.reshape(7, 576))
    assert torch.equal(a.reshape(7, 288), b) and torch.equal(sa, sb)
    c, sc = quant.quantize_mxfp4(torch.randn(3, 64).to(torch.bfloat16))
    assert c.shape == (3, 32) and sc.shape == (256, 8)
    with pytest.raises(ValueError):
        quant.quantize_mxfp4(torch.randn(2, 48))


def test_dequantize_accepts_other_scale_layouts_and_dtypes() -> None:
    kv = torch.randn(9, 1, 576).to(torch.bfloat16)
    fp4, scale = quant.quantize_mxfp4(kv)
    ref = quant.dequantize_mxfp4(fp4, scale)
    trimmed = scale[:9, :18].contiguous()          # newer aiter: (N, 18)
    col_major = scale[:9, :18].t().contiguous().t()  # aiter triton: strides (1, N)
    assert torch.equal(quant.dequantize_mxfp4(fp4, trimmed), ref)
    assert torch.equal(quant.dequantize_mxfp4(fp4, col_major), ref)
    assert torch.equal(
        quant.dequantize_mxfp4(fp4.view(torch.float4_e2m1fn_x2),
                               scale.view(torch.float8_e8m0fnu)), ref)
    with pytest.raises(ValueError):
        quant.dequantize_mxfp4(fp4, scale[:8])


def test_e8m0_decoding() -> None:
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    f = quant.e8m0_to_float(b)
    assert f[0].item() == 2.0 ** -127 and f[1].item() == 2.0 ** -126
    assert f[2:6].tolist() == [0.5, 1.0, 2.0, 2.0 ** 127]
    assert math.isnan(f[6].item())


# ---------------------------------------------------------------- MXFP4: against the scalar model

def _edge_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(576, generator=g) * s
            for s in (1.0, 0.05, 3.0, 1e3, 2.0 ** -100, 2.0 ** 100)]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 7.0, 7.5,
                         0.125, 0.375, -0.25, -0.75, -5.0, -6.0, 1.0, 4.0, 4.5, 5.5,
                         2.75, 3.25, -0.0, 0.0, 1e-30, -1e-30, 0.2, 0.3, 0.7, 0.8, 2.25])
    row = torch.zeros(576)
    for b in range(18):                        # the tie pattern at 18 block scales
        row[32 * b:32 * b + 32] = ties * 2.0 ** (b - 9)
    rows.append(row)
    rows.append(torch.zeros(576))
    return torch.stack(rows).reshape(-1, 1, 576).to(torch.bfloat16)


@pytest.mark.parametrize("ties", ["away", "even"])
def test_bit_exact_against_scalar_rule(ties: str) -> None:
    kv = _edge_rows()
    fp4, scale = quant.quantize_mxfp4(kv, ties=ties)
    want_fp4, want_scale = scalar_quantize_rows(_rows_of(kv), ties)
    n = kv.shape[0]
    assert fp4.reshape(n, 288).tolist() == want_fp4
    assert scale[:n, :18].tolist() == want_scale


def test_round_trip_error_and_idempotence() -> None:
    kv = (torch.randn(40, 1, 576) * 2).to(torch.bfloat16)
    fp4, scale = quant.quantize_mxfp4(kv)
    deq = quant.dequantize_mxfp4(fp4, scale)
    step = quant.e8m0_to_float(scale[:40, :18]).repeat_interleave(32, dim=1).reshape(40, 1, 576)
    assert ((deq - kv.float()).abs() <= step).all()      # error <= one 2^e step
    fp4b, scaleb = quant.quantize_mxfp4(deq)             # grid values map to themselves
    assert torch.equal(fp4, fp4b) and torch.equal(scale, scaleb)


# ---------------------------------------------------------------- fp8

def test_fp8_hand_values() -> None:
    kv = torch.tensor([448.0, 17.0, 19.0, -100.0, 0.0, 1.0 / 1024]).to(torch.bfloat16)
    kv_fp8, scale = quant.quantize_fp8(kv)
    assert kv_fp8.dtype == torch.float8_e4m3fn
    assert scale.dtype == torch.float32 and scale.shape == (1,) and scale.item() == 1.0
    # step 2 in [16, 32): ties 17 -> 16 and 19 -> 20 (round half to even); 2^-10 -> 0
    assert kv_fp8.float().tolist() == [448.0, 16.0, 20.0, -96.0, 0.0, 0.0]
    assert torch.equal(quant.dequantize_fp8(kv_fp8, scale), kv_fp8.float())


def test_fp8_scale_and_clamp() -> None:
    kv = torch.tensor([[-896.0, 2.0, 300.0]]).to(torch.bfloat16)
    kv_fp8, scale = quant.quantize_fp8(kv)
    assert scale.item() == 2.0
    assert kv_fp8.float().tolist() == [[-448.0, 1.0, 144.0]]
    deq = quant.dequantize_fp8(kv_fp8, scale)
    assert deq.tolist() == [[-896.0, 2.0, 288.0]]
    zeros_fp8, zscale = quant.quantize_fp8(torch.zeros(4, 1, 8, dtype=torch.bfloat16))
    assert zscale.item() == pytest.approx(1e-12 / 448)
    assert zeros_fp8.float().abs().sum() == 0


def test_fp8_round_trip_relative_error() -> None:
    kv = torch.randn(64, 1, 576).to(torch.bfloat16)
    kv_fp8, scale = quant.quantize_fp8(kv)
    deq = quant.dequantize_fp8(kv_fp8, scale)
    err = (deq - kv.float()).abs()
    # e4m3 keeps 3 mantissa bits: half a step is <= 2^-4 relative above the subnormals
    assert (err <= kv.float().abs() * 2.0 ** -4 + scale * 2.0 ** -10).all()


def test_fp8_dtype_cpu_and_mi300(monkeypatch: pytest.MonkeyPatch) -> None:
    assert quant.fp8_dtype() == torch.float8_e4m3fn
    assert quant.fp8_dtype("cpu") == torch.float8_e4m3fn
    arch = {"name": "gfx942:sramecc+:xnack-"}
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(gcnArchName=arch["name"]))
    assert quant.fp8_dtype() == torch.float8_e4m3fnuz
    assert quant.fp8_dtype("cuda:0") == torch.float8_e4m3fnuz
    arch["name"] = "gfx950"
    assert quant.fp8_dtype(0) == torch.float8_e4m3fn
