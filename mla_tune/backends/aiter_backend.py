"""aiter's MLA decode (`aiter.mla.mla_decode_fwd`) as a kernel family: the AMD baseline.

Written against the current ROCm/aiter API (commit `AITER_COMMIT`; the PyPI `amd-aiter`
wheel predates `page_size`, `nhead_kv` and `intra_batch_mode`). Not run on AMD hardware
here: what is checked is that the calls bind to aiter's signatures at that commit
(tests/backends/test_aiter_backend.py). For that, everything the calls need (page table,
KV view shapes, metadata buffer sizes, every scalar argument) comes from the pure function
`plan_aiter_call`, which runs on a CPU without aiter; `build` only moves the plan to the
GPU, fills aiter's work metadata once, warms up, and returns a closure that launches.

Knobs (`configs/backends/aiter.toml`), the variants of the seed submission:
- `mode`: `bf16` (bf16 Q and KV, non-persistent split-KV kernel), `bf16_persistent`
  (bf16, persistent kernel driven by work metadata), `a16w8` (bf16 Q, fp8 KV, persistent),
  `a8w8` (fp8 Q quantized per tensor on every call like the leaderboard's reference, fp8 KV,
  persistent);
- `page_size`: the page size the contiguous cache is viewed as (zero-copy, see vendor.py);
- `num_kv_splits`: KV splits per sequence; 0 lets aiter choose (non-persistent only);
- `fast_mode`, `intra_batch_mode`: how `get_mla_metadata_v1` schedules persistent work.

Causality: aiter's default `causal=True` masks key k for query j iff k > L - q_len + j
(its reference `ref_masked_attention` uses `tril(diagonal = L - q_len)`), the rule of
problem.md.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mla_tune.backends import vendor
from mla_tune.backends.base import Availability, Backend, KernelFn
from mla_tune.machine.fingerprint import installed_version
from mla_tune.problem import quant
from mla_tune.problem.shapes import QK_HEAD_DIM, SM_SCALE, V_HEAD_DIM, KVFormat, Shape, TaskInput
from mla_tune.tuning.space import load_backend_space

AITER_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
"""The ROCm/aiter commit whose `aiter/mla.py` and `aiter/ops/attention.py` this follows."""

PIP_HINT = "pip install 'mla-tune[rocm]'"

PERSISTENT_MODES = ("bf16_persistent", "a16w8", "a8w8")
MODE_FORMATS = {"bf16": KVFormat.BF16, "bf16_persistent": KVFormat.BF16,
                "a16w8": KVFormat.FP8, "a8w8": KVFormat.FP8}

METADATA_BUFFERS = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
                    "reduce_final_map", "reduce_partial_map")
"""`mla_decode_fwd`'s names of the six buffers, in `get_mla_metadata_info_v1`'s order."""

_METADATA_ARG_NAMES = {"work_meta_data": "work_metadata_ptrs"}
"""Where `get_mla_metadata_v1` names a buffer differently from `mla_decode_fwd`."""

REQUIRED_DECODE_PARAMS = frozenset({"page_size", "nhead_kv", "intra_batch_mode", "causal"})
"""`mla_decode_fwd` parameters this family passes that older aiter releases lack."""


@dataclass(frozen=True)
class AiterTarget:
    """The GPU a call is planned for: aiter sizes its metadata by architecture and CU count."""

    gfx: str
    cu_num: int


MI355X = AiterTarget("gfx950", 256)
MI300X = AiterTarget("gfx942", 304)


@dataclass(frozen=True)
class BufferSpec:
    """One metadata buffer to allocate: `torch.empty(shape, dtype=dtype)`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class AiterPlan:
    """Every argument of the aiter calls for one variant, minus the per-call tensors."""

    mode: str
    persistent: bool
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    page_size: int
    out_shape: tuple[int, int, int]
    kv_view_shape: tuple[int, int, int, int]
    """`(num_pages, page_size, nhead_kv, 576)`: the view of the `(total_kv, 1, 576)` cache."""
    indices: dict[str, torch.Tensor]
    """CPU int32 `qo_indptr`, page-level `kv_indptr`, `kv_indices`, `kv_last_page_lens`."""
    metadata_info_kwargs: dict[str, Any]
    """Arguments of `get_mla_metadata_info_v1` (persistent modes)."""
    metadata_buffers: tuple[BufferSpec, ...]
    """The buffers `get_mla_metadata_info_v1` asks for on the plan's target, as read at
    `AITER_COMMIT` with AITER_ENABLE_EXPERIMENTAL off; empty for non-persistent modes."""
    metadata_kwargs: dict[str, Any]
    """Scalar arguments of `get_mla_metadata_v1` (persistent modes)."""
    decode_kwargs: dict[str, Any]
    """Scalar arguments of `mla_decode_fwd`."""


def _qo_tiles_per_batch(target: AiterTarget, heads: int, q_len: int, q_fp8: bool,
                        kv_fp8: bool) -> int:
    """`max_qo_tiles_per_batch` of `get_mla_metadata_info_v1` (non-sparse, experimental off)."""
    packed = heads * q_len
    gfx950 = target.gfx == "gfx950"
    bf16 = not q_fp8 and not kv_fp8
    fp8 = q_fp8 and kv_fp8
    if (gfx950 and bf16 and packed >= 64 and heads <= 64 and (packed < 128 or heads == 48)) \
            or (gfx950 and fp8 and heads == 32 and q_len == 3):
        return q_len if heads * 2 > 64 else math.ceil(packed / 64)
    if (heads == 16
            or (target.gfx == "gfx942" and heads == 128 and fp8)
            or (gfx950 and fp8 and ((heads == 32 and q_len == 4) or heads in (64, 128)))
            or (target.gfx in ("gfx942", "gfx950") and heads == 64 and fp8 and q_len == 1)):
        return math.ceil(packed / 128)
    if gfx950 and (packed >= 128 or heads > 64) and bf16 and heads != 48:
        return q_len if heads * 2 > 128 else math.ceil(packed / 128)
    return math.ceil(packed / 16)


def metadata_buffer_specs(target: AiterTarget, batch: int, q_len: int, heads: int,
                          q_fp8: bool, kv_fp8: bool, fast_mode: bool, num_kv_splits: int,
                          intra_batch_mode: bool) -> tuple[BufferSpec, ...]:
    """The six buffers of `get_mla_metadata_info_v1` at `AITER_COMMIT`, for the arguments
    this family passes (`max_split_per_batch = num_kv_splits`, one KV head, occupancy 1)."""
    max_splits = target.cu_num
    tiles = _qo_tiles_per_batch(target, heads, q_len, q_fp8, kv_fp8)
    tile_cnt = batch * tiles
    if fast_mode:
        max_work = (batch + max_splits - 1) * tiles
        max_split_tiles = min(batch + max_splits - 1, (max_splits - 1) * 2) * tiles
    else:
        max_work = max_split_tiles = tile_cnt * max_splits
    max_split_tiles = max(max_split_tiles, tile_cnt + min(max_splits, num_kv_splits * batch))
    if intra_batch_mode:
        max_work = max_split_tiles = tile_cnt * num_kv_splits
    shapes = ((2,), (max_splits + 1,), (max_work, 8), (tile_cnt + 1,), (tile_cnt, 2),
              (max_split_tiles,))
    dtypes = (torch.uint64,) + (torch.int32,) * 5
    return tuple(BufferSpec(n, s, d) for n, s, d in zip(METADATA_BUFFERS, shapes, dtypes))


def plan_aiter_call(shape: Shape, config: Mapping[str, Any], target: AiterTarget,
                    fp8_dtype: torch.dtype) -> AiterPlan:
    """Plan one variant on `target`; `fp8_dtype` is aiter's `dtypes.fp8` there (e4m3fn on
    gfx950, e4m3fnuz on gfx942). Pure: no aiter, no GPU."""
    mode = str(config["mode"])
    if mode not in MODE_FORMATS:
        raise ValueError(f"unknown aiter mode {mode!r}; choose one of {sorted(MODE_FORMATS)}")
    persistent = mode in PERSISTENT_MODES
    q_fp8, kv_fp8 = mode == "a8w8", mode in ("a16w8", "a8w8")
    q_dtype = fp8_dtype if q_fp8 else torch.bfloat16
    kv_dtype = fp8_dtype if kv_fp8 else torch.bfloat16
    page_size = int(config["page_size"])
    splits = int(config["num_kv_splits"])
    fast_mode, intra = bool(config["fast_mode"]), bool(config["intra_batch_mode"])
    if persistent and splits < 1:
        raise ValueError(f"persistent mode {mode!r} needs num_kv_splits >= 1")
    table = vendor.contiguous_page_table(shape.kv_lens, page_size)
    indices = {
        "qo_indptr": torch.arange(0, shape.total_q + 1, shape.q_len, dtype=torch.int32),
        "kv_indptr": table.kv_indptr,
        "kv_indices": table.kv_indices,
        "kv_last_page_lens": table.last_page_len,
    }
    decode_kwargs: dict[str, Any] = {
        "max_seqlen_q": shape.q_len,
        "page_size": page_size,
        "nhead_kv": 1,
        "sm_scale": SM_SCALE,
        "num_kv_splits": splits if splits > 0 else None,
        "intra_batch_mode": intra if persistent else False,
        "causal": True,
    }
    info_kwargs: dict[str, Any] = {}
    meta_kwargs: dict[str, Any] = {}
    buffers: tuple[BufferSpec, ...] = ()
    if persistent:
        info_kwargs = {
            "batch_size": shape.batch, "max_seqlen_qo": shape.q_len, "num_head_qo": shape.heads,
            "q_dtype": q_dtype, "kv_dtype": kv_dtype, "is_sparse": False,
            "fast_mode": fast_mode, "num_kv_splits": splits, "intra_batch_mode": intra,
            "max_split_per_batch": splits,
        }
        # aiter's own tests: 16-token KV granules, 32 for the qh64 fp8 kernel.
        granule = 32 if shape.heads == 64 and q_fp8 and kv_fp8 else 16
        meta_kwargs = {
            "num_heads_per_head_k": shape.heads, "num_heads_k": 1, "is_causal": True,
            "page_size": page_size, "kv_granularity": max(page_size, granule),
            "max_seqlen_qo": shape.q_len, "uni_seqlen_qo": shape.q_len,
            "fast_mode": fast_mode, "max_split_per_batch": splits,
            "intra_batch_mode": intra, "dtype_q": q_dtype, "dtype_kv": kv_dtype,
        }
        buffers = metadata_buffer_specs(target, shape.batch, shape.q_len, shape.heads, q_fp8,
                                        kv_fp8, fast_mode, splits, intra)
    return AiterPlan(
        mode=mode, persistent=persistent, q_dtype=q_dtype, kv_dtype=kv_dtype,
        page_size=page_size,
        out_shape=(shape.total_q, shape.heads, V_HEAD_DIM),
        kv_view_shape=(table.num_pages, page_size, 1, QK_HEAD_DIM),
        indices=indices, metadata_info_kwargs=info_kwargs, metadata_buffers=buffers,
        metadata_kwargs=meta_kwargs, decode_kwargs=decode_kwargs,
    )


def metadata_call_kwargs(plan: AiterPlan, indices: Mapping[str, torch.Tensor],
                         buffers: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """All keyword arguments of `get_mla_metadata_v1`, which fills `buffers` in place."""
    kwargs: dict[str, Any] = {
        "seqlens_qo_indptr": indices["qo_indptr"],
        "seqlens_kv_indptr": indices["kv_indptr"],
        "kv_last_page_lens": indices["kv_last_page_lens"],
    }
    kwargs.update({_METADATA_ARG_NAMES.get(n, n): buffers[n] for n in METADATA_BUFFERS})
    kwargs.update(plan.metadata_kwargs)
    return kwargs


def decode_call_kwargs(plan: AiterPlan, q: torch.Tensor, kv_buffer: torch.Tensor,
                       o: torch.Tensor, indices: Mapping[str, torch.Tensor],
                       buffers: Mapping[str, torch.Tensor], q_scale: torch.Tensor | None,
                       kv_scale: torch.Tensor | None) -> dict[str, Any]:
    """All keyword arguments of `mla_decode_fwd` for one call (it writes `o`)."""
    return {"q": q, "kv_buffer": kv_buffer, "o": o, **indices, **plan.decode_kwargs,
            **buffers, "q_scale": q_scale, "kv_scale": kv_scale}


def _shape_tuple(size: int | tuple[int, ...]) -> tuple[int, ...]:
    return (int(size),) if isinstance(size, int) else tuple(int(s) for s in size)


class AiterBackend(Backend):
    """aiter `mla_decode_fwd` on MI300/MI355X (see module docstring for the knobs)."""

    name = "aiter"
    description = "aiter mla_decode_fwd (vendor baseline, AMD MI300/MI355X)"
    plans_own_rows = True  # its planner tiles the rows of any q_len x heads itself

    def available(self, device: torch.device) -> Availability:
        dev = torch.device(device)
        if not torch.version.hip:
            return Availability(False, "aiter runs on AMD ROCm GPUs (MI300/MI355X); this torch "
                                       "is not a ROCm build")
        if dev.type != "cuda" or not torch.cuda.is_available():
            return Availability(False, f"aiter needs an AMD GPU; torch sees none for device {dev}")
        if importlib.util.find_spec("aiter") is None:
            return Availability(False, f"aiter is not installed: {PIP_HINT} (or build ROCm/aiter "
                                       "from source: the PyPI wheel predates the API used here)")
        try:
            from aiter import get_mla_metadata_info_v1, get_mla_metadata_v1  # noqa: F401
            from aiter.mla import mla_decode_fwd
        except Exception as exc:  # noqa: BLE001 - any import failure is the reason to report
            return Availability(False, f"import aiter failed: {type(exc).__name__}: {exc}")
        missing = REQUIRED_DECODE_PARAMS - set(inspect.signature(mla_decode_fwd).parameters)
        if missing:
            return Availability(False, f"this aiter is too old: mla_decode_fwd lacks "
                                       f"{sorted(missing)}; install ROCm/aiter from source")
        return Availability(True)

    def supports(self, shape: Shape) -> str | None:
        if shape.kv_format is KVFormat.MXFP4:
            return "no MXFP4-KV mode of aiter mla_decode_fwd is wired up here"
        return None

    def feasible(self, shape: Shape, config: Mapping[str, Any]) -> bool:
        mode = str(config["mode"])
        if MODE_FORMATS.get(mode) is not shape.kv_format:
            return False
        if vendor.page_layout_problem(shape.kv_lens, int(config["page_size"])):
            return False
        if mode in PERSISTENT_MODES:
            return int(config["num_kv_splits"]) > 0
        # The non-persistent kernel ignores the metadata knobs: keep one point of them.
        space = load_backend_space(self.name)
        return all(config[k] == space.choices(k)[0] for k in ("fast_mode", "intra_batch_mode"))

    def build(self, shape: Shape, config: Mapping[str, Any], device: torch.device) -> KernelFn:
        from aiter import dtypes, get_mla_metadata_info_v1, get_mla_metadata_v1
        from aiter.jit.utils.chip_info import get_cu_num, get_gfx
        from aiter.mla import mla_decode_fwd

        dev = torch.device(device)
        plan = plan_aiter_call(shape, config, AiterTarget(get_gfx(), get_cu_num()), dtypes.fp8)
        indices = {k: v.to(dev) for k, v in plan.indices.items()}
        buffers: dict[str, torch.Tensor] = {}
        if plan.persistent:
            info = get_mla_metadata_info_v1(**plan.metadata_info_kwargs)
            specs = tuple(BufferSpec(n, _shape_tuple(s), t)
                          for n, (s, t) in zip(METADATA_BUFFERS, info))
            if specs != plan.metadata_buffers:
                warnings.warn(f"aiter sizes its MLA metadata unlike the plan read at commit "
                              f"{AITER_COMMIT[:12]}: {specs} vs {plan.metadata_buffers}; "
                              "using aiter's sizes", RuntimeWarning, stacklevel=2)
            buffers = {s.name: torch.empty(s.shape, dtype=s.dtype, device=dev) for s in specs}
            get_mla_metadata_v1(**metadata_call_kwargs(plan, indices, buffers))
        kv_key = "bf16" if plan.kv_dtype == torch.bfloat16 else "fp8"

        def run(data: TaskInput) -> torch.Tensor:
            q, q_scale = data[0], None
            if plan.q_dtype != torch.bfloat16:
                q, q_scale = quant.quantize_fp8(q)
            entry = data[1][kv_key]
            kv, kv_scale = (entry, None) if kv_key == "bf16" else entry
            o = torch.empty(plan.out_shape, dtype=torch.bfloat16, device=q.device)
            mla_decode_fwd(**decode_call_kwargs(plan, q, kv.view(plan.kv_view_shape), o,
                                                indices, buffers, q_scale, kv_scale))
            return o

        run(vendor.warmup_input(shape, plan.kv_dtype, dev))
        torch.cuda.synchronize(dev)
        return run

    def source_files(self) -> list[Path]:
        return [Path(__file__), Path(vendor.__file__)]

    def versions(self) -> dict[str, str]:
        version = installed_version("amd-aiter", "aiter")
        return {"aiter": version} if version else {}

