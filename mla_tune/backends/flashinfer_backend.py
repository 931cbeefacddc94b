"""FlashInfer's MLA decode (`flashinfer.mla.BatchMLAPagedAttentionWrapper`) as a kernel family.

It is the vendor baseline on NVIDIA. Written against FlashInfer 0.7.4 (the wheel the H200
runs; its plan/run API is recorded in tests/backends/test_flashinfer_backend.py). Per build:
a page table over the contiguous cache (`vendor.py`), one `plan()` (which JIT-compiles the
module on first use, about 22 s per backend and KV dtype) and one warm-up call, so a timed
call does only what a serving step would: slice views and launch.

Knobs (`configs/backends/flashinfer.toml`):
- `backend`: FlashInfer's kernel family: `fa3` (Hopper), `fa2`, or `auto` (FlashInfer picks;
  fa3 on SM90).
- `page_size`: the page size the contiguous cache is viewed as (zero-copy, so every kv length
  must be a multiple of it).
- `launch`: `wrapper` calls `run()`, which re-validates its arguments in Python on every call;
  `direct` replays the planned native module with the arguments `run()` would pass, skipping
  that work (per-call Python time is timed, as on the leaderboard). `direct` reads wrapper
  internals of FlashInfer 0.7.x and fails at build, not silently, if they change.
- `fp8_scale` (fp8 KV only): FlashInfer takes the per-tensor KV scale as a host float. `host`
  reads it back every call (one device sync); `fold` keeps it on the device: q is multiplied
  by the scale before the kernel, the output after it, and the kernel runs with scale 1.

Causality (q_len > 1): FlashInfer masks key k for query j iff k > L - q_len + j
(`include/flashinfer/attention/mla.cuh`), the rule of problem.md, so those shapes run as is.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mla_tune.backends import vendor
from mla_tune.backends.base import Availability, Backend, KernelFn
from mla_tune.problem import quant
from mla_tune.problem.shapes import (
    KV_LORA_RANK,
    QK_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    SM_SCALE,
    V_HEAD_DIM,
    KVFormat,
    Shape,
    TaskInput,
)

PIP_HINT = "pip install 'mla-tune[cuda]'"
WORKSPACE_BYTES = 128 * 2**20
"""Float workspace for split-KV partial results (FlashInfer's documented starting point)."""

Launch = Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]


@dataclass(frozen=True)
class FlashInferPlan:
    """What `build` hands FlashInfer, computed from the shape alone (no GPU, no FlashInfer),
    so CPU tests can check it against FlashInfer's signatures."""

    backend: str
    launch: str
    fp8_scale: str
    page_size: int
    num_pages: int
    kv_dtype: torch.dtype
    metadata: dict[str, torch.Tensor]
    """Keyword arguments of `MLAPlanMetadata.csr` (CPU int32 tensors)."""
    plan_kwargs: dict[str, Any]
    """Keyword arguments of `BatchMLAPagedAttentionWrapper.plan` besides `metadata`."""

    @property
    def kv_is_fp8(self) -> bool:
        return self.kv_dtype != torch.bfloat16

    @property
    def kv_view_shape(self) -> tuple[int, int, int]:
        """The paged view of the `(total_kv, 1, 576)` cache FlashInfer reads."""
        return (self.num_pages, self.page_size, QK_HEAD_DIM)


def make_plan(shape: Shape, config: Mapping[str, Any],
              fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> FlashInferPlan:
    """The plan for one variant: CSR page table over the contiguous cache plus `plan()`'s
    arguments. Packed layouts: q and KV rows are passed whole (576 = 512 + 64)."""
    page_size = int(config["page_size"])
    table = vendor.contiguous_page_table(shape.kv_lens, page_size)
    kv_dtype = torch.bfloat16 if shape.kv_format is KVFormat.BF16 else fp8_dtype
    qo_indptr = torch.arange(0, shape.total_q + 1, shape.q_len, dtype=torch.int32)
    plan_kwargs: dict[str, Any] = {
        "num_heads": shape.heads,
        "head_dim_ckv": KV_LORA_RANK,
        "head_dim_kpe": QK_ROPE_HEAD_DIM,
        "page_size": page_size,
        "causal": shape.q_len > 1,
        "sm_scale": SM_SCALE,
        "q_data_type": torch.bfloat16,
        "kv_data_type": kv_dtype,
        "query_layout": "packed",
        "kv_cache_layout": "packed",
    }
    if kv_dtype != torch.bfloat16:
        plan_kwargs["scale_mode"] = "kv-per-tensor"
    return FlashInferPlan(
        backend=str(config["backend"]),
        launch=str(config["launch"]),
        fp8_scale=str(config["fp8_scale"]),
        page_size=page_size,
        num_pages=table.num_pages,
        kv_dtype=kv_dtype,
        metadata={"qo_indptr": qo_indptr, "kv_indptr": table.kv_indptr,
                  "kv_indices": table.kv_indices, "kv_len_arr": table.kv_lens},
        plan_kwargs=plan_kwargs,
    )


def run_kwargs(query: torch.Tensor, kv_cache: torch.Tensor,
               kv_scale: float | None) -> dict[str, Any]:
    """Keyword arguments of `BatchMLAPagedAttentionWrapper.run` for packed q and KV pages;
    fp8 plans need the KV scale for both the 512 latent and the 64 rope columns."""
    kwargs: dict[str, Any] = {"query": query, "kv_cache": kv_cache}
    if kv_scale is not None:
        kwargs.update(ckv_scale=kv_scale, kpe_scale=kv_scale)
    return kwargs


def _wrapper_launch(wrapper: Any) -> Launch:
    def launch(q: torch.Tensor, kv: torch.Tensor, scale: float | None) -> torch.Tensor:
        return wrapper.run(**run_kwargs(q, kv, scale))

    return launch


def _direct_launch(wrapper: Any, plan: FlashInferPlan, heads: int) -> Launch:
    """Call the planned native module exactly as `run()` finally does (FlashInfer 0.7.4,
    `_BatchMLAGeneratedFaMechanics._run_generated_fa`), without its Python validation."""
    planned = getattr(wrapper, "_planned_backend_name", None)
    if planned not in ("fa2", "fa3"):
        raise RuntimeError(f"launch='direct' replays FlashInfer's fa2/fa3 module; the plan chose "
                           f"{planned!r}: use launch='wrapper'")
    try:
        module = wrapper._cached_module
        float_ws, int_ws = wrapper._float_workspace_buffer, wrapper._int_workspace_buffer
        plan_info, kv_indices = wrapper._plan_info, wrapper._kv_indices_buf
        from flashinfer.utils import MaskMode
    except (AttributeError, ImportError) as exc:
        raise RuntimeError("launch='direct' relies on FlashInfer 0.7.x wrapper internals that "
                           f"this FlashInfer lacks ({exc}); use launch='wrapper'") from exc
    mask = (MaskMode.CAUSAL if plan.plan_kwargs["causal"] else MaskMode.NON_CAUSAL).value
    page_size, sm_scale = plan.page_size, float(plan.plan_kwargs["sm_scale"])

    def launch(q: torch.Tensor, kv: torch.Tensor, scale: float | None) -> torch.Tensor:
        out = torch.empty((q.shape[0], heads, V_HEAD_DIM), dtype=torch.bfloat16, device=q.device)
        s = 1.0 if scale is None else scale
        module.run(float_ws, int_ws, plan_info, q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:],
                   kv[..., :KV_LORA_RANK], kv[..., KV_LORA_RANK:], kv_indices, out, None, mask,
                   heads, page_size, sm_scale, False, s, s, None)
        return out

    return launch


def _kernel(plan: FlashInferPlan, launch: Launch, shape: Shape,
            device: torch.device) -> KernelFn:
    view = plan.kv_view_shape
    if not plan.kv_is_fp8:
        def run_bf16(data: TaskInput) -> torch.Tensor:
            return launch(data[0], data[1]["bf16"].view(view), None)

        return run_bf16
    if plan.fp8_scale == "host":
        def run_fp8_host(data: TaskInput) -> torch.Tensor:
            kv, scale = data[1]["fp8"]
            return launch(data[0], kv.view(view), float(scale))

        return run_fp8_host
    q_scaled = torch.empty((shape.total_q, shape.heads, QK_HEAD_DIM), dtype=torch.bfloat16,
                           device=device)

    def run_fp8_fold(data: TaskInput) -> torch.Tensor:
        kv, scale = data[1]["fp8"]
        torch.mul(data[0], scale, out=q_scaled)
        return launch(q_scaled, kv.view(view), 1.0).mul_(scale)

    return run_fp8_fold


class FlashInferBackend(Backend):
    """FlashInfer's batch MLA paged decode (see module docstring for the knobs)."""

    name = "flashinfer"
    description = "FlashInfer BatchMLAPagedAttentionWrapper (vendor baseline, NVIDIA)"
    plans_own_rows = True  # its planner tiles the rows of any q_len x heads itself

    def available(self, device: torch.device) -> Availability:
        dev = torch.device(device)
        if dev.type != "cuda":
            return Availability(False,
                                f"FlashInfer runs on NVIDIA CUDA GPUs; device {dev} is not one")
        if torch.version.hip:
            return Availability(False, "FlashInfer runs on NVIDIA CUDA GPUs; this torch is a "
                                       f"ROCm build (HIP {torch.version.hip})")
        if not torch.cuda.is_available():
            return Availability(False, "FlashInfer needs an NVIDIA GPU; torch sees no CUDA device")
        if importlib.util.find_spec("flashinfer") is None:
            return Availability(False, f"FlashInfer is not installed: {PIP_HINT}")
        try:
            import flashinfer.mla  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure is the reason to report
            return Availability(False, f"import flashinfer.mla failed: {type(exc).__name__}: {exc}")
        major, minor = torch.cuda.get_device_capability(dev)
        if major < 8:
            return Availability(False, "FlashInfer's MLA decode needs SM80 or newer, "
                                       f"got SM{major}{minor}")
        return Availability(True)

    def supports(self, shape: Shape) -> str | None:
        if shape.kv_format is KVFormat.MXFP4:
            return "FlashInfer has no MXFP4-KV MLA decode"
        return None

    def feasible(self, shape: Shape, config: Mapping[str, Any]) -> bool:
        if vendor.page_layout_problem(shape.kv_lens, int(config["page_size"])):
            return False
        # fp8_scale means nothing for bf16 KV: keep one point instead of duplicates.
        return shape.kv_format is KVFormat.FP8 or config["fp8_scale"] == "host"

    def precheck(self, shape: Shape, config: Mapping[str, Any],
                 device: torch.device) -> str | None:
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(dev)
        if config["backend"] == "fa3" and major != 9:
            return f"FlashInfer's fa3 MLA backend needs SM90 (Hopper), got SM{major}{minor}"
        if shape.kv_format is KVFormat.FP8 and major != 9:
            return f"FlashInfer's fp8-KV MLA decode needs SM90 (Hopper), got SM{major}{minor}"
        return None

    def build(self, shape: Shape, config: Mapping[str, Any], device: torch.device) -> KernelFn:
        import flashinfer.mla as fmla

        dev = torch.device(device)
        plan = make_plan(shape, config, quant.fp8_dtype(dev))
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        wrapper = fmla.BatchMLAPagedAttentionWrapper(workspace, backend=plan.backend)
        wrapper.plan(metadata=fmla.MLAPlanMetadata.csr(**plan.metadata), **plan.plan_kwargs)
        launch = (_direct_launch(wrapper, plan, shape.heads) if plan.launch == "direct"
                  else _wrapper_launch(wrapper))
        fn = _kernel(plan, launch, shape, dev)
        fn(vendor.warmup_input(shape, plan.kv_dtype, dev))
        torch.cuda.synchronize(dev)
        return fn

    def source_files(self) -> list[Path]:
        return [Path(__file__), Path(vendor.__file__)]

    def versions(self) -> dict[str, str]:
        try:
            return {"flashinfer": importlib.metadata.version("flashinfer-python")}
        except importlib.metadata.PackageNotFoundError:
            return {}
