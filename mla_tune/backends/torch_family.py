"""Pure-PyTorch MLA decode: split-KV with an online softmax and a log-sum-exp merge.

It runs wherever torch runs, so every machine (CPU CI included) has a family to tune, and
it is the fallback of last resort for the dispatcher. Knobs:
- `num_splits`: the kv range of each sequence is cut into this many parts computed as one
  batched product and merged by log-sum-exp (flash-decoding, in PyTorch);
- `chunk_size`: tokens per step of the online softmax inside a split (0 = whole split), which
  bounds the temporaries;
- `compute_dtype`: dtype of the two matrix products (softmax statistics stay float32).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mla_tune.backends.base import Availability, Backend, KernelFn
from mla_tune.problem.shapes import V_HEAD_DIM, KVFormat, Shape, TaskInput

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dequantize(kv_data: dict[str, Any], kv_format: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """The KV cache as a (total_kv, 576) tensor of `dtype`."""
    from mla_tune.problem import quant

    if kv_format is KVFormat.BF16:
        kv = kv_data["bf16"]
    elif kv_format is KVFormat.FP8:
        kv_fp8, scale = kv_data["fp8"]
        kv = quant.dequantize_fp8(kv_fp8, scale)
    else:
        fp4, scales = kv_data["mxfp4"]
        kv = quant.dequantize_mxfp4(fp4, scales)
    return kv.reshape(kv.shape[0], -1).to(dtype)


class _Plan:
    """Everything about a shape that can be computed once: token gather indices, the
    additive causal/padding mask, and the split geometry."""

    def __init__(self, shape: Shape, num_splits: int, chunk_size: int,
                 device: torch.device) -> None:
        self.shape = shape
        lmax = shape.kv_len
        self.splits = max(1, min(num_splits, lmax))
        self.split_len = -(-lmax // self.splits)
        self.chunk = self.split_len if chunk_size <= 0 else min(chunk_size, self.split_len)
        self.split_len = -(-self.split_len // self.chunk) * self.chunk
        lpad = self.split_len * self.splits
        lens = torch.tensor(shape.kv_lens, device=device)
        starts = torch.cumsum(torch.nn.functional.pad(lens, (1, 0)), 0)[:-1]
        t = torch.arange(lpad, device=device)
        # Uniform contiguous batches are a free view; anything else is gathered.
        self.contiguous = not shape.is_ragged and lpad == lmax
        self.index = (starts[:, None] + t.clamp(max=lmax - 1)[None, :]).clamp(
            max=shape.total_kv - 1)
        # Query j of a sequence of length L sees keys t <= L - q_len + j.
        j = torch.arange(shape.q_len, device=device)
        limit = lens[:, None] - shape.q_len + j[None, :]
        allowed = t[None, None, :] <= limit[:, :, None]
        self.bias: torch.Tensor | None = None
        if bool(allowed.all()):
            return
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
        bias.masked_fill_(~allowed, float("-inf"))
        # (B, S, q_len*H rows, split_len): one bias row per query token, repeated per head.
        bias = bias.view(shape.batch, shape.q_len, self.splits, self.split_len)
        self.bias = bias.permute(0, 2, 1, 3).repeat_interleave(shape.heads, dim=2)


class TorchFamily(Backend):
    """Split-KV decode in plain PyTorch (see module docstring for the knobs)."""

    name = "torch"
    description = "pure PyTorch split-KV decode (runs on CPU and GPU)"

    def available(self, device: torch.device) -> Availability:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            return Availability(False, "torch reports no CUDA device")
        return Availability(True)

    def feasible(self, shape: Shape, config: Mapping[str, Any]) -> bool:
        splits, chunk = int(config["num_splits"]), int(config["chunk_size"])
        if splits > 1 and shape.kv_len // splits < 16:
            return False
        return chunk == 0 or chunk < -(-shape.kv_len // splits)

    def build(self, shape: Shape, config: Mapping[str, Any], device: torch.device) -> KernelFn:
        dev = torch.device(device)
        plan = _Plan(shape, int(config["num_splits"]), int(config["chunk_size"]), dev)
        dtype = _DTYPES[str(config["compute_dtype"])]
        fmt = shape.kv_format

        def run(data: TaskInput) -> torch.Tensor:
            q, kv_data, _qo, _kv, cfg = data
            return _decode(q, _dequantize(kv_data, fmt, dtype), plan, dtype,
                           float(cfg["sm_scale"]))

        return run

    def source_files(self) -> list[Path]:
        return [Path(__file__)]


def _decode(q: torch.Tensor, kv: torch.Tensor, plan: _Plan, dtype: torch.dtype,
            sm_scale: float) -> torch.Tensor:
    shape = plan.shape
    b, s, sl, rows = shape.batch, plan.splits, plan.split_len, shape.q_len * shape.heads
    if plan.contiguous:
        keys = kv.view(b, s, sl, kv.shape[-1])
    else:
        keys = kv[plan.index].view(b, s, sl, kv.shape[-1])
    qs = (q.reshape(b, 1, rows, q.shape[-1]).to(dtype) * sm_scale)
    m = torch.full((b, s, rows, 1), float("-inf"), device=q.device)
    denom = torch.zeros((b, s, rows, 1), device=q.device)
    acc = torch.zeros((b, s, rows, V_HEAD_DIM), device=q.device)
    for c0 in range(0, sl, plan.chunk):
        k = keys[:, :, c0:c0 + plan.chunk]
        logits = torch.matmul(qs, k.transpose(-1, -2)).float()
        if plan.bias is not None:
            logits = logits + plan.bias[..., c0:c0 + plan.chunk]
        m_new = torch.maximum(m, logits.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(logits - m_safe)
        alpha = torch.exp(m - m_safe)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p.to(dtype), k[..., :V_HEAD_DIM]).float()
        m = m_new
    # Log-sum-exp merge of the splits; splits that saw no key carry zero weight.
    w = torch.exp(m - m.amax(1, keepdim=True))
    out = (acc * w).sum(1) / (denom * w).sum(1)
    return out.view(shape.total_q, shape.heads, V_HEAD_DIM).to(torch.bfloat16)
