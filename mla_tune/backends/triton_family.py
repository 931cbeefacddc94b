"""The Triton MLA decode family (kernels/triton): one kernel source for NVIDIA sm_90 and AMD
gfx950, every tuning knob a parameter (configs/backends/triton.toml).

On CPU it is available only under TRITON_INTERPRET=1 (the interpreter, for tests); variants
are pruned before any GPU time by `feasible` (shape arithmetic) and `precheck` (compile for
the device's target and reject register spills or shared-memory overflow). The launch rules
(which points run a shape, the kernel config of a point, the built launcher) are
kernels/triton/launch.py's, which the one-file submission carries too; they are part of the
family's source hash.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import mla_tune.kernels.triton
from mla_tune.backends.base import Availability, Backend, KernelFn
from mla_tune.problem.shapes import SM_SCALE, KVFormat, Shape
from mla_tune.tuning.space import ParamSpace

_KERNEL_DIR = Path(mla_tune.kernels.triton.__file__).resolve().parent


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_config(shape: Shape, config: Mapping[str, Any]):
    """The kernel's KernelConfig for a point of the space on `shape` (kernels/triton/launch.py
    holds the launch rules)."""
    from mla_tune.kernels.triton.launch import variant_config

    return variant_config(shape.kv_format.value, shape.page_size, config)


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
            import mla_tune.kernels.triton.mla_decode  # noqa: F401 - defines (parses) the kernels
        except Exception as e:  # noqa: BLE001 - any import failure is the reason to report
            return Availability(False, f"kernels/triton does not import: {type(e).__name__}: {e}")
        return Availability(True)

    def supports(self, shape: Shape) -> str | None:
        if shape.kv_format is KVFormat.FP8 and torch.version.hip and torch.cuda.is_available():
            arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
            if arch == "gfx942":
                return "fp8 kernels use OCP e4m3fn; MI300 (gfx942) stores e4m3fnuz"
        return None

    def declared_space(self, device: torch.device) -> ParamSpace:
        """The TOML space, taking the launch rules' meaning of knobs a stored config lacks
        (`KNOB_DEFAULTS`: configs tuned before the knob keep routing)."""
        from mla_tune.kernels.triton.launch import KNOB_DEFAULTS

        return super().declared_space(device).with_defaults(KNOB_DEFAULTS)

    def feasible(self, shape: Shape, config: Mapping[str, Any]) -> bool:
        from mla_tune.kernels.triton.launch import variant_feasible

        return variant_feasible(shape.kv_format.value, shape.kv_lens, shape.q_len,
                                shape.heads, shape.page_size, config)

    def precheck(self, shape: Shape, config: Mapping[str, Any],
                 device: torch.device) -> str | None:
        if _interpreting() or torch.device(device).type != "cuda":
            return None
        from mla_tune.kernels.triton import static_check

        cfg = kernel_config(shape, config)
        return static_check.check(cfg, [_target_name(torch.device(device))], heads=shape.heads)

    def compile_key(self, shape: Shape, config: Mapping[str, Any],
                    device: torch.device) -> tuple | None:
        if _interpreting() or torch.device(device).type != "cuda":
            return None
        from mla_tune.kernels.triton import static_check

        return static_check.compiled_key(kernel_config(shape, config), shape.heads)

    def compile_ahead(self, shape: Shape, config: Mapping[str, Any], arch: str) -> None:
        from mla_tune.kernels.triton import static_check
        from mla_tune.kernels.triton.precompile import target_for_arch

        target = target_for_arch(arch)
        if target is not None:
            static_check.compile_ahead(kernel_config(shape, config), target, heads=shape.heads)

    def build(self, shape: Shape, config: Mapping[str, Any], device: torch.device) -> KernelFn:
        from mla_tune.kernels.triton.launch import build_variant

        return build_variant(shape.kv_format.value, list(shape.kv_lens), shape.q_len,
                             shape.heads, config, device, page_size=shape.page_size,
                             sm_scale=SM_SCALE)

    def source_files(self) -> list[Path]:
        return [_KERNEL_DIR / "mla_decode.py", _KERNEL_DIR / "launch.py", Path(__file__)]
