"""The correctness oracle: MLA decode in float32 on the dequantized cache.

Independent of any kernel library on purpose: a kernel is right when it matches this
within the format's tolerance (`verify.py`), not when it matches another fast kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from mla_tune.problem import quant
from mla_tune.problem.shapes import V_HEAD_DIM, KVFormat


def dequantized_kv(kv_data: Mapping[str, Any] | Any, kv_format: KVFormat | str) -> torch.Tensor:
    """float32 `(N, 1, 576)` values of the cache in `kv_format`, exactly as a kernel must
    see them. `kv_data` is the task's dict (all formats) or that format's entry alone."""
    fmt = KVFormat(kv_format)
    entry = kv_data[fmt.value] if isinstance(kv_data, Mapping) else kv_data
    if fmt is KVFormat.BF16:
        return entry.float()
    if fmt is KVFormat.FP8:
        kv_fp8, scale = entry
        return quant.dequantize_fp8(kv_fp8, scale)
    kv_fp4, scale_e8m0 = entry
    return quant.dequantize_mxfp4(kv_fp4, scale_e8m0)


@contextlib.contextmanager
def _ieee_fp32_matmul() -> Iterator[None]:
    """Keep TF32 out of the reference on CUDA even if the caller enabled it globally.

    Uses the `fp32_precision` API where torch has it: torch refuses to read the legacy
    `allow_tf32` flag once the new one was set."""
    m = torch.backends.cuda.matmul
    attr, value = ("fp32_precision", "ieee") if hasattr(m, "fp32_precision") \
        else ("allow_tf32", False)
    saved = getattr(m, attr)
    setattr(m, attr, value)
    try:
        yield
    finally:
        setattr(m, attr, saved)


def mla_decode_reference(q: torch.Tensor, kv_data: Mapping[str, Any] | Any,
                         qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                         config: Mapping[str, Any],
                         kv_format: KVFormat | str = "bf16") -> torch.Tensor:
    """float32 `(total_q, H, 512)` attention output for the task tuple.

    Per sequence b (ragged via the indptrs): keys are all 576 dims of each KV row, values
    its first 512; scores use `config["sm_scale"]`; with `q_len = qo[b+1] - qo[b]` and kv
    length `L`, query j sees keys `[0, L - q_len + j]` (decode with draft tokens).
    `q` is taken as float32 as given (bf16 -> float32 is exact); the KV is dequantized
    exactly. Runs on whatever device the inputs are on."""
    kv = dequantized_kv(kv_data, kv_format)
    if kv.dim() == 3:
        kv = kv[:, 0, :]
    dv = int(config.get("v_head_dim", V_HEAD_DIM))
    sm_scale = float(config["sm_scale"])
    qf = q.float()
    total_q, heads, dqk = qf.shape
    if kv.shape[-1] != dqk:
        raise ValueError(f"q head dim {dqk} != kv dim {kv.shape[-1]}")
    kv = kv.to(qf.device)
    qo = [int(v) for v in qo_indptr.tolist()]
    kvp = [int(v) for v in kv_indptr.tolist()]
    if len(qo) != len(kvp):
        raise ValueError(f"qo_indptr has {len(qo)} entries, kv_indptr {len(kvp)}")
    if qo[-1] != total_q:
        raise ValueError(f"qo_indptr ends at {qo[-1]} but q has {total_q} tokens")
    if kvp[-1] > kv.shape[0]:
        raise ValueError(f"kv_indptr ends at {kvp[-1]} but the cache has {kv.shape[0]} rows")

    out = torch.empty((total_q, heads, dv), dtype=torch.float32, device=qf.device)
    guard = _ieee_fp32_matmul() if qf.is_cuda else contextlib.nullcontext()
    with guard:
        for b in range(len(qo) - 1):
            q0, q1, k0, k1 = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
            ql, length = q1 - q0, k1 - k0
            if ql == 0:
                continue
            if length < ql:
                raise ValueError(f"sequence {b}: kv length {length} < q length {ql}")
            keys = kv[k0:k1]                                   # (L, 576)
            scores = torch.einsum("qhd,kd->qhk", qf[q0:q1], keys) * sm_scale
            # key k is visible to query j iff k <= L - ql + j
            j = torch.arange(ql, device=qf.device).view(ql, 1, 1)
            k = torch.arange(length, device=qf.device).view(1, 1, length)
            scores = scores.masked_fill(k > length - ql + j, float("-inf"))
            p = torch.softmax(scores, dim=-1)
            out[q0:q1] = torch.einsum("qhk,kd->qhd", p, keys[:, :dv])
    return out
