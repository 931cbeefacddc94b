"""The float32 reference against a naive per-(token, head) loop, and its causal rule."""

from __future__ import annotations

import math

import pytest
import torch

from mla_tune.problem import quant
from mla_tune.problem.reference import dequantized_kv, mla_decode_reference
from mla_tune.problem.shapes import KVFormat, Shape, generate_input


def naive_reference(q: torch.Tensor, kv: torch.Tensor, qo: list[int], kvp: list[int],
                    sm_scale: float) -> torch.Tensor:
    """One (token, head) at a time in float64, keys visible by the rule in problem.md."""
    q64, kv64 = q.double(), kv.double().reshape(kv.shape[0], -1)
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    for b in range(len(qo) - 1):
        ql, length = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
        for j in range(ql):
            last = length - ql + j                       # last visible key
            for h in range(q.shape[1]):
                qv = q64[qo[b] + j, h]
                scores = [float(qv @ kv64[kvp[b] + k]) * sm_scale for k in range(last + 1)]
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                total = sum(w)
                acc = torch.zeros(512, dtype=torch.float64)
                for k, wk in enumerate(w):
                    acc += (wk / total) * kv64[kvp[b] + k, :512]
                out[qo[b] + j, h] = acc
    return out


SHAPES = [
    Shape(3, (1, 17, 64), q_len=1, heads=16),
    Shape(2, (4, 33), q_len=4, heads=16),
    Shape(3, (9, 5, 40), q_len=4, heads=32),
    Shape(1, (64,), q_len=1, heads=32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label())
def test_matches_naive_loop(shape: Shape) -> None:
    q, kv_data, qo, kvp, config = generate_input(shape, seed=3)
    out = mla_decode_reference(q, kv_data, qo, kvp, config)
    assert out.dtype == torch.float32 and out.shape == (shape.total_q, shape.heads, 512)
    want = naive_reference(q, kv_data["bf16"], qo.tolist(), kvp.tolist(), config["sm_scale"])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", KVFormat.MXFP4])
def test_quantized_formats_use_dequantized_cache(fmt: str | KVFormat) -> None:
    shape = Shape(2, (6, 20), q_len=4, heads=16)
    q, kv_data, qo, kvp, config = generate_input(shape, seed=1)
    deq = dequantized_kv(kv_data, fmt)
    assert deq.dtype == torch.float32 and deq.shape == (26, 1, 576)
    out = mla_decode_reference(q, kv_data, qo, kvp, config, kv_format=fmt)
    want = naive_reference(q, deq, qo.tolist(), kvp.tolist(), config["sm_scale"])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    # and the formats really differ from bf16
    assert not torch.allclose(out, mla_decode_reference(q, kv_data, qo, kvp, config))


def test_dequantized_kv_entries() -> None:
    kv = torch.randn(5, 1, 576).to(torch.bfloat16)
    assert torch.equal(dequantized_kv({"bf16": kv}, "bf16"), kv.float())
    pair = quant.quantize_fp8(kv)
    assert torch.equal(dequantized_kv(pair, "fp8"), quant.dequantize_fp8(*pair))
    with pytest.raises(ValueError):
        dequantized_kv({"bf16": kv}, "int4")


def test_causal_rule() -> None:
    """Query j of a sequence with kv length L sees keys 0 .. L - q_len + j, no more."""
    shape = Shape(1, (6,), q_len=4, heads=16)
    q, kv_data, qo, kvp, config = generate_input(shape, seed=5)
    kv = kv_data["bf16"].clone()
    base = mla_decode_reference(q, {"bf16": kv}, qo, kvp, config)
    # L = 6, q_len = 4: query j sees keys 0..2+j. Poisoning key 4 may change queries 2, 3.
    poisoned = kv.clone()
    poisoned[4] = 50.0
    out = mla_decode_reference(q, {"bf16": poisoned}, qo, kvp, config)
    assert torch.equal(out[:2], base[:2])
    assert not torch.allclose(out[2], base[2]) and not torch.allclose(out[3], base[3])
    # key 5 (the last) is seen by the last query only
    poisoned = kv.clone()
    poisoned[5] = 50.0
    out = mla_decode_reference(q, {"bf16": poisoned}, qo, kvp, config)
    assert torch.equal(out[:3], base[:3]) and not torch.allclose(out[3], base[3])


def test_first_draft_token_with_minimal_kv_sees_one_key() -> None:
    shape = Shape(2, (4, 4), q_len=4, heads=16)
    q, kv_data, qo, kvp, config = generate_input(shape, seed=2)
    out = mla_decode_reference(q, kv_data, qo, kvp, config)
    v = kv_data["bf16"].float()[:, 0, :512]
    for b in range(2):
        # query 0 of each sequence sees only key 0 of that sequence: output = its value row
        torch.testing.assert_close(out[4 * b], v[4 * b].expand(16, 512), rtol=0, atol=1e-6)


def test_sm_scale_and_value_dims_come_from_config() -> None:
    shape = Shape(1, (8,), q_len=1, heads=16)
    q, kv_data, qo, kvp, config = generate_input(shape, seed=4)
    hot = dict(config, sm_scale=config["sm_scale"] * 4)
    a = mla_decode_reference(q, kv_data, qo, kvp, config)
    b = mla_decode_reference(q, kv_data, qo, kvp, hot)
    want = naive_reference(q, kv_data["bf16"], [0, 1], [0, 8], hot["sm_scale"])
    assert not torch.allclose(a, b)
    torch.testing.assert_close(b.double(), want, rtol=1e-5, atol=1e-6)
    # the rope dims (512..575) take part in the scores but not in the values
    kv2 = kv_data["bf16"].clone()
    kv2[:, :, 512:] = 0
    c = mla_decode_reference(q, {"bf16": kv2}, qo, kvp, config)
    assert not torch.allclose(a, c)


def test_rejects_inconsistent_inputs() -> None:
    shape = Shape(2, (4, 8), q_len=2, heads=16)
    q, kv_data, qo, kvp, config = generate_input(shape)
    with pytest.raises(ValueError):
        mla_decode_reference(q[:3], kv_data, qo, kvp, config)
    with pytest.raises(ValueError):   # a sequence shorter than its queries
        mla_decode_reference(q, kv_data, qo, torch.tensor([0, 1, 12], dtype=torch.int32), config)
