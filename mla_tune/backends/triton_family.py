"""The Triton MLA decode family (kernels/triton): one kernel source for NVIDIA sm_90 and AMD
gfx950, every tuning knob a parameter (configs/backends/triton.toml).

On CPU it is available only under TRITON_INTERPRET=1 (the interpreter, for tests); variants
are pruned before any GPU time by `feasible` (shape arithmetic) and `precheck` (compile for
the device's target and reject register spills or shared-memory overflow).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mla_tune.backends.base import Availability, Backend, KernelFn
from mla_tune.problem import SM_SCALE, KVFormat, Shape, TaskInput

_KERNEL_DIR = Path(__file__).resolve().parent.parent.parent / "kernels" / "triton"

_COMPUTE_BY_FORMAT = {
    KVFormat.BF16: ("bf16",),
    KVFormat.FP8: ("bf16", "fp16", "fp8", "fp8qk"),
    KVFormat.MXFP4: ("bf16",),
}
"""Compute paths that make sense per KV format (bf16 KV is not re-quantized; MXFP4 blocks
scales along the head dim, so only bf16 holds the decoded values exactly)."""

_WARPS_FOR_BLOCK_M = {16: 4, 32: 4, 64: 8, 128: 8}
"""The accumulator is 512 x block_m float32: 64 rows need two warpgroups to stay in
registers, 16 rows fit one (measured on H200: 8 warps at 16 rows was 1.3-1.7x slower)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_config(shape: Shape, config: Mapping[str, Any]):
    """The kernel's KernelConfig for a point of the space on `shape`."""
    from kernels.triton.mla_decode import KernelConfig

    return KernelConfig(
        kv_format=shape.kv_format.value, compute=str(config["compute"]),
        block_m=int(config["block_m"]), block_n=int(config["block_n"]),
        num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"]),
        num_splits=int(config["num_splits"]), page_size=_page_size(shape, config),
        fast_mode=bool(config["fast_mode"]),
        fp8_convert=str(config.get("fp8_convert", "staged")),
        kv_load=str(config.get("kv_load", "pointer")))


def _page_size(shape: Shape, config: Mapping[str, Any]) -> int:
    """A paged shape is read with its own page size; the knob applies to contiguous ones."""
    return shape.page_size if shape.page_size > 1 else int(config["page_size"])


def _target_name(device: torch.device) -> str:
    from triton.runtime import driver

    t = driver.active.get_current_target()
    return f"{t.backend}:{t.arch}"


class TritonFamily(Backend):
    """Split-KV MLA decode in Triton (bf16, fp8 and MXFP4 KV read in their stored form)."""

    name = "triton"
    description = "Triton split-KV MLA decode (sm_90 / gfx950), all three KV formats"

    def available(self, device: torch.device) -> Availability:
        dev = torch.device(device)
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return Availability(False, f"triton is not importable: {e}")
        if _interpreting():
            if dev.type != "cpu":
                return Availability(False, "TRITON_INTERPRET=1 runs on CPU tensors only")
            return Availability(True)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return Availability(False, "needs a CUDA or HIP GPU (or TRITON_INTERPRET=1 on CPU "
                                       "for tests)")
        try:
            import kernels.triton.mla_decode  # noqa: F401 - defines (parses) the kernels
        except Exception as e:  # noqa: BLE001 - any import failure is the reason to report
            return Availability(False, f"kernels/triton does not import: {type(e).__name__}: {e}")
        return Availability(True)

    def supports(self, shape: Shape) -> str | None:
        if shape.kv_format is KVFormat.FP8 and torch.version.hip and torch.cuda.is_available():
            arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
            if arch == "gfx942":
                return "fp8 kernels use OCP e4m3fn; MI300 (gfx942) stores e4m3fnuz"
        return None

    def feasible(self, shape: Shape, config: Mapping[str, Any]) -> bool:
        if str(config["compute"]) not in _COMPUTE_BY_FORMAT[shape.kv_format]:
            return False
        block_m, block_n = int(config["block_m"]), int(config["block_n"])
        if _WARPS_FOR_BLOCK_M.get(block_m) != int(config["num_warps"]):
            return False
        rows = shape.q_len * shape.heads
        if block_m > 16 and block_m >= 2 * rows:
            return False  # half the rows or more would be padding
        if shape.page_size > 1 and int(config["page_size"]) != 1:
            return False  # paged shapes use their own page size; avoid duplicate points
        # fp8 KV converted for the MMAs (fp8qk converts the values, to fp16).
        converts_fp8 = shape.kv_format is KVFormat.FP8 and str(config["compute"]) != "fp8"
        if not converts_fp8 and str(config.get("fp8_convert", "staged")) != "staged":
            return False  # the knob only exists for fp8 KV on 16-bit MMAs
        kv_load = str(config.get("kv_load", "pointer"))
        if kv_load in ("tma", "tma_host") and (
                _page_size(shape, config) > 1 or not (
                    shape.kv_format is KVFormat.BF16 or
                    (shape.kv_format is KVFormat.FP8 and str(config["compute"]) == "fp8"))):
            return False  # see kv_load in configs/backends/triton.toml
        if kv_load == "tma_host" and (shape.q_len != 1 or
                                      any(L % block_n for L in shape.kv_lens)):
            return False  # shared descriptors: mla_decode.tiles_stay_inside must hold
        splits = int(config["num_splits"])
        return splits * block_n <= shape.kv_len

    def precheck(self, shape: Shape, config: Mapping[str, Any],
                 device: torch.device) -> str | None:
        if _interpreting() or torch.device(device).type != "cuda":
            return None
        from kernels.triton import static_check

        cfg = kernel_config(shape, config)
        return static_check.check(cfg, [_target_name(torch.device(device))], heads=shape.heads)

    def compile_key(self, shape: Shape, config: Mapping[str, Any],
                    device: torch.device) -> tuple | None:
        if _interpreting() or torch.device(device).type != "cuda":
            return None
        from kernels.triton import static_check

        return static_check.compiled_key(kernel_config(shape, config), shape.heads)

    def compile_ahead(self, shape: Shape, config: Mapping[str, Any], arch: str) -> None:
        from kernels.triton import static_check
        from kernels.triton.precompile import target_for_arch

        target = target_for_arch(arch)
        if target is not None:
            static_check.compile_ahead(kernel_config(shape, config), target, heads=shape.heads)

    def build(self, shape: Shape, config: Mapping[str, Any], device: torch.device) -> KernelFn:
        from kernels.triton.mla_decode import MlaDecodeLauncher

        cfg = kernel_config(shape, config)
        launcher = MlaDecodeLauncher(cfg, heads=shape.heads, q_len=shape.q_len,
                                     kv_lens=list(shape.kv_lens), device=device,
                                     sm_scale=SM_SCALE)
        fmt = shape.kv_format
        # The MXFP4 scale tensor's row stride as aiter pads it: 24 bytes (18 used).
        launcher.prepare(sc_stride=24 if fmt is KVFormat.MXFP4 else 0)

        if fmt is KVFormat.BF16:
            def run(data: TaskInput) -> torch.Tensor:
                q, kv_data, qo, kvp, _ = data
                return launcher(q, kv_data["bf16"], None, None, qo, kvp)
        elif fmt is KVFormat.FP8:
            def run(data: TaskInput) -> torch.Tensor:
                q, kv_data, qo, kvp, _ = data
                kv, scale = kv_data["fp8"]
                return launcher(q, kv, scale, None, qo, kvp)
        else:
            def run(data: TaskInput) -> torch.Tensor:
                q, kv_data, qo, kvp, _ = data
                kv, scale = kv_data["mxfp4"]
                if kv.dtype != torch.uint8:  # float4_e2m1fn_x2 storage: same bytes
                    kv = kv.view(torch.uint8)
                return launcher(q, kv, None, scale, qo, kvp)
        return run

    def source_files(self) -> list[Path]:
        return [_KERNEL_DIR / "mla_decode.py", Path(__file__)]
