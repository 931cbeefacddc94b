"""The correctness gate: metrics, failure reasons, and that the shipped tolerances pass
correct low-precision kernels but catch a dropped token or a missing causal mask."""

from __future__ import annotations

import pytest
import torch

from mla_tune.problem import quant
from mla_tune.problem.reference import dequantized_kv, mla_decode_reference
from mla_tune.problem.shapes import KVFormat, Shape, generate_input
from mla_tune.problem.verify import Tolerance, VerifyResult, check, tolerance_for

FORMATS = ["bf16", "fp8", "mxfp4"]


def _case(shape: Shape, fmt: str, seed: int = 0):
    q, kv_data, qo, kvp, config = generate_input(shape, seed=seed)
    ref = mla_decode_reference(q, kv_data, qo, kvp, config, fmt)
    return q, kv_data, qo, kvp, config, ref


def _flash_like(q: torch.Tensor, kv: torch.Tensor, qo: list[int], kvp: list[int],
                sm_scale: float, *, q_fp8: bool = False, causal: bool = True,
                drop_last_of: int | None = None) -> torch.Tensor:
    """A plausible kernel: fp32 scores, P rounded to bf16 before P@V, bf16 output.
    Optionally quantizes Q to fp8 (a8w8 style), ignores the mask, or drops a key."""
    qf = q.float()
    if q_fp8:
        qf = quant.dequantize_fp8(*quant.quantize_fp8(q))
    keys_all = kv.float()[:, 0]
    out = torch.empty(q.shape[0], q.shape[1], 512)
    for b in range(len(qo) - 1):
        k0, k1 = kvp[b], kvp[b + 1] - (1 if b == drop_last_of else 0)
        ql, length = qo[b + 1] - qo[b], k1 - k0
        keys = keys_all[k0:k1]
        s = torch.einsum("qhd,kd->qhk", qf[qo[b]:qo[b + 1]], keys) * sm_scale
        if causal:
            j = torch.arange(ql).view(ql, 1, 1)
            s = s.masked_fill(torch.arange(length).view(1, 1, -1) > length - ql + j,
                              float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        pv = torch.einsum("qhk,kd->qhd", e.to(torch.bfloat16).float(), keys[:, :512])
        out[qo[b]:qo[b + 1]] = pv / e.sum(-1, keepdim=True)
    return out.to(torch.bfloat16)


def _run(shape: Shape, fmt: str, seed: int = 0, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    q, kv_data, qo, kvp, config, ref = _case(shape, fmt, seed)
    out = _flash_like(q, dequantized_kv(kv_data, fmt), qo.tolist(), kvp.tolist(),
                      config["sm_scale"], **kw)
    return out, ref


# ---------------------------------------------------------------- tolerances file

def test_tolerances_for_every_format() -> None:
    for fmt in list(FORMATS) + [KVFormat.FP8]:
        tol = tolerance_for(fmt)
        assert isinstance(tol, Tolerance)
        assert 0 < tol.rtol <= 0.2 and 0 < tol.atol <= 0.05 and 0 <= tol.max_mismatch_frac < 0.01
    # outputs are ~0.05 at long kv: the exact formats must gate far below that
    assert tolerance_for("bf16").atol <= 2e-3 and tolerance_for("mxfp4").atol <= 2e-3
    with pytest.raises(ValueError):
        tolerance_for("int4")
    with pytest.raises(ValueError):
        Tolerance(rtol=-1, atol=0)


# ---------------------------------------------------------------- metrics and reasons

def test_exact_output_passes_with_metrics() -> None:
    ref = torch.randn(4, 16, 512)
    res = check(ref.clone(), ref, Tolerance(1e-2, 1e-3))
    assert res.ok and bool(res) and res.max_abs_err == 0.0 and res.mismatch_frac == 0.0
    assert res.reason == ""
    res = check(ref.to(torch.bfloat16), ref, tolerance_for("bf16"))
    assert res.ok and 0 < res.max_abs_err < 0.05 and res.mismatch_frac == 0.0


def test_metrics_count_mismatches() -> None:
    ref = torch.ones(10, 100)
    out = ref.clone()
    out[:, :7] += 0.5                               # 7% of elements off by 0.5
    res = check(out, ref, Tolerance(rtol=0.0, atol=0.1, max_mismatch_frac=0.1))
    assert res.ok and res.mismatch_frac == pytest.approx(0.07)
    assert res.max_abs_err == pytest.approx(0.5)
    res = check(out, ref, Tolerance(rtol=0.0, atol=0.1, max_mismatch_frac=0.05))
    assert not res.ok and res.mismatch_frac == pytest.approx(0.07)
    assert "70 of 1000" in res.reason and "max abs err 0.5" in res.reason
    # rtol scales with |ref|: 0.5 is within 0.6 * |1|
    assert check(out, ref, Tolerance(rtol=0.6, atol=0.0)).ok


@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite_output_fails(bad: float, word: str) -> None:
    ref = torch.randn(2, 16, 512)
    out = ref.to(torch.bfloat16)
    out[1, 3, 7] = bad
    res = check(out, ref, Tolerance(1.0, 1.0, 1.0))       # even the loosest gate
    assert not res.ok and word in res.reason and "1 non-finite" in res.reason
    assert res.mismatch_frac == pytest.approx(1 / out.numel())


def test_shape_and_type_mismatch_fail() -> None:
    ref = torch.randn(2, 16, 512)
    res = check(torch.randn(2, 16, 576), ref, tolerance_for("bf16"))
    assert not res.ok and "shape" in res.reason
    assert not check(torch.zeros(2, 16, 512, dtype=torch.int32), ref, Tolerance(1, 1)).ok
    assert isinstance(check(ref, ref, Tolerance(0, 0)), VerifyResult)


# ---------------------------------------------------------------- the shipped gates

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [Shape(3, (5, 33, 64), q_len=4, heads=16),
                                   Shape(2, (8, 8), q_len=1, heads=32)],
                         ids=lambda s: s.label())
def test_correct_bf16_kernel_passes(fmt: str, shape: Shape) -> None:
    out, ref = _run(shape, fmt, seed=1)
    res = check(out, ref, tolerance_for(fmt))
    assert res.ok, res.reason


@pytest.mark.parametrize("shape", [Shape(3, (5, 33, 64), q_len=4, heads=16),
                                   Shape(2, (8, 8), q_len=1, heads=32)],
                         ids=lambda s: s.label())
def test_fp8_query_kernel_passes_fp8_gate(shape: Shape) -> None:
    out, ref = _run(shape, "fp8", seed=2, q_fp8=True)
    res = check(out, ref, tolerance_for("fp8"))
    assert res.ok, res.reason
    assert not check(out, ref, tolerance_for("bf16")).ok   # too noisy for the exact gate


@pytest.mark.parametrize("fmt", FORMATS)
def test_dropped_token_fails(fmt: str) -> None:
    shape = Shape(3, (12, 16, 20), q_len=1, heads=16)
    out, ref = _run(shape, fmt, drop_last_of=0)           # one short sequence loses a key
    res = check(out, ref, tolerance_for(fmt))
    assert not res.ok and res.mismatch_frac > 0.01
    assert res.max_abs_err > 0.05


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_causal_mask_fails(fmt: str) -> None:
    shape = Shape(2, (16, 24), q_len=4, heads=16)
    out, ref = _run(shape, fmt, causal=False)
    res = check(out, ref, tolerance_for(fmt))
    assert not res.ok and res.mismatch_frac > 0.05


def test_exact_gate_catches_drop_at_kv_64_in_one_sequence() -> None:
    out, ref = _run(Shape(3, (64, 64, 64), q_len=1, heads=16), "bf16", drop_last_of=1)
    assert not check(out, ref, tolerance_for("bf16")).ok
