"""The checks of a task call's inputs, in the standard library and torch alone.

`mla_tune.runtime.dispatcher` checks a shape's first call (and any call its runner's fast checks
refuse) with these, and `mla-tune export --submission` copies this file's source verbatim
into the one-file leaderboard submission, so the installed dispatcher and an exported file
refuse the same inputs with the same messages: the config's fields, the tensors' sizes
against the config before anything is built from it, and each tensor's dtype, shape,
device and layout for the KV format the call runs in. A wrong input is a ValueError that
names the argument. Its imports are the standard library, torch and the
standard-library routing rules alone (tests/runtime/test_submission_export.py checks it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mla_tune.runtime.routing_rules import CALL_KEY_FIELDS

TASK_QK_DIM = 576
"""Key/query head dim (kv_lora_rank 512 + rope 64): the last dim of q and of the cache."""

TASK_V_DIM = 512
"""Value/output head dim: the first 512 dims of each cached row."""

TASK_SM_SCALE = 1.0 / math.sqrt(TASK_QK_DIM)
"""The task's softmax scale, built into the tuned kernels."""

TASK_FIXED_FIELDS = {"num_kv_heads": 1, "qk_head_dim": TASK_QK_DIM, "kv_lora_rank": TASK_V_DIM,
                     "qk_rope_head_dim": TASK_QK_DIM - TASK_V_DIM, "v_head_dim": TASK_V_DIM}
"""Config fields every call carries with exactly these values (the kernels assume them)."""

FP4_PACKED_DIM = TASK_QK_DIM // 2
"""Bytes per MXFP4 row: two E2M1 values a byte."""

MXFP4_BLOCKS = TASK_QK_DIM // 32
"""E8M0 scale bytes used per MXFP4 row (one per 32 values)."""

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz})
FP4_DTYPES = frozenset({torch.uint8} | ({torch.float4_e2m1fn_x2}
                                       if hasattr(torch, "float4_e2m1fn_x2") else set()))
E8M0_DTYPES = frozenset({torch.uint8} | ({torch.float8_e8m0fnu}
                                        if hasattr(torch, "float8_e8m0fnu") else set()))


def check_config(config: Any) -> dict[str, int]:
    """The key fields of a call's config (`CALL_KEY_FIELDS`), after checking every field
    the task's config has (a missing or other-valued one is a ValueError naming it): the
    kernels assume them, and the tuned kernels' scale is built in."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    vals = {}
    for f in CALL_KEY_FIELDS:
        v = config.get(f)
        if type(v) is not int or v < 1:
            raise ValueError(f"config[{f!r}] must be a positive int, got {v!r:.80}")
        vals[f] = v
    for f, want in TASK_FIXED_FIELDS.items():
        if f not in config:
            raise ValueError(f"config lacks {f!r} (the task's config has {f}={want})")
        if config[f] != want:
            raise ValueError(f"config[{f!r}] is {config[f]!r:.80}; MLA decode here needs "
                             f"{want}")
    scale = config.get("sm_scale")
    if scale is None:
        raise ValueError(f"config lacks 'sm_scale' (the task's is 1/sqrt({TASK_QK_DIM}) = "
                         f"{TASK_SM_SCALE})")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isclose(scale, TASK_SM_SCALE, rel_tol=1e-6):
        raise ValueError(f"config['sm_scale'] is {scale!r:.80}; the tuned kernels use "
                         f"1/sqrt({TASK_QK_DIM}) = {TASK_SM_SCALE}")
    return vals


def check_sizes(data: Any, vals: Mapping[str, int]) -> None:
    """Compare the config (`check_config`'s values) with the tensors' sizes before anything
    is built from it, so a config claiming a batch of 10**8 fails at once instead of after
    gigabytes."""
    batch, rows = vals["batch_size"], vals["batch_size"] * vals["q_seq_len"]
    q, _, qo, kvp, _ = data
    if isinstance(q, torch.Tensor) and q.dim() == 3 \
            and (q.shape[0] != rows or q.shape[1] != vals["num_heads"]):
        raise ValueError(f"q has shape {tuple(q.shape)}; config batch_size {batch}, "
                         f"q_seq_len {vals['q_seq_len']} and num_heads {vals['num_heads']} "
                         f"need ({rows}, {vals['num_heads']}, {TASK_QK_DIM})")
    for t, n in ((qo, "qo_indptr"), (kvp, "kv_indptr")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.numel() != batch + 1:
            raise ValueError(f"{n} has {t.numel()} elements; expected {batch + 1} (config "
                             f"batch_size {batch})")


def check_tensor(t: Any, name: str, dtypes: Iterable[torch.dtype],
                 shape: tuple[int, ...] | int, device: torch.device,
                 contiguous: bool = False) -> None:
    """Raise ValueError naming `name` unless `t` matches. `shape` is exact, except that a
    negative entry -n means at least n; an int means that many elements, any shape."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = sorted(str(d) for d in dtypes)
    if str(t.dtype) not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {' or '.join(allowed)}")
    if isinstance(shape, int):
        if t.numel() != shape:
            raise ValueError(f"{name} has {t.numel()} elements; expected {shape}")
    elif t.dim() != len(shape) or any(t.shape[i] < -w if w < 0 else t.shape[i] != w
                                      for i, w in enumerate(shape)):
        want = tuple(f">={-w}" if w < 0 else w for w in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; the kernels here run on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_task_tensors(data: Any, batch: int, q_len: int, heads: int, total_kv: int,
                       kv_format: str, device: torch.device) -> None:
    """Check a call's tensors for a shape of `batch` sequences of `q_len` queries of
    `heads` heads over `total_kv` KV rows, run in format `kv_format` (only that format's
    entry of kv_data is read) on `device`."""
    if not isinstance(data, (tuple, list)) or len(data) != 5:
        raise ValueError("data must be the tuple (q, kv_data, qo_indptr, kv_indptr, config)")
    q, kv_data, qo, kvp, _ = data
    check_tensor(q, "q", [torch.bfloat16], (batch * q_len, heads, TASK_QK_DIM), device,
                 contiguous=True)
    if not isinstance(kv_data, Mapping):
        raise ValueError(f"kv_data must be a dict of KV formats, got {type(kv_data).__name__}")
    if kv_format not in kv_data:
        raise ValueError(f"kv_data lacks {kv_format!r}, the format this call runs in")
    entry, name, rows = kv_data[kv_format], f"kv_data[{kv_format!r}]", total_kv
    if kv_format == "bf16":
        check_tensor(entry, name, [torch.bfloat16], (rows, 1, TASK_QK_DIM), device, True)
    else:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"{name} must be a (values, scale) pair")
        if kv_format == "fp8":
            check_tensor(entry[0], f"{name}[0]", FP8_DTYPES, (rows, 1, TASK_QK_DIM), device,
                         True)
            check_tensor(entry[1], f"{name}[1]", [torch.float32], 1, device)
        else:
            check_tensor(entry[0], f"{name}[0]", FP4_DTYPES, (rows, 1, FP4_PACKED_DIM),
                         device, True)
            check_tensor(entry[1], f"{name}[1]", E8M0_DTYPES, (-rows, -MXFP4_BLOCKS),
                         device)
    for t, n in ((qo, "qo_indptr"), (kvp, "kv_indptr")):
        check_tensor(t, n, [torch.int32], batch + 1, device)


def kv_rows(kv_data: Mapping[str, Any], formats: Iterable[str]) -> int:
    """KV rows of a call: the first dimension of the values of the first of `formats` that
    kv_data holds (host metadata only: no device read)."""
    for f in formats:
        if f in kv_data:
            e = kv_data[f]
            return int((e if isinstance(e, torch.Tensor) else e[0]).shape[0])
    raise ValueError(f"kv_data holds none of {list(formats)}")
