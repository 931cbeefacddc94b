"""The Gluon Hopper MLA decode family (kernels/gluon): warpgroup MMAs with the KV tokens on
the M side, tiles by TMA, fp8 and MXFP4 decoded once per tile into bf16 operands
(configs/backends/gluon.toml).

Available on sm_90 GPUs only (Gluon has no interpreter); `precheck` cross-compiles a variant
for sm_90a and rejects shared-memory overflow or register spills before any GPU time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import mla_tune.kernels.gluon
from mla_tune.backends.base import Availability, Backend, KernelFn
from mla_tune.problem.shapes import SM_SCALE, Shape

_KERNEL_DIR = Path(mla_tune.kernels.gluon.__file__).resolve().parent


class GluonFamily(Backend):
    """Split-KV MLA decode in Gluon for Hopper (bf16, fp8 and MXFP4 KV)."""

    name = "gluon"
    description = "Gluon warpgroup-MMA split-KV MLA decode (sm_90a), all three KV formats"

    def available(self, device: torch.device) -> Availability:
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available() or torch.version.hip:
            return Availability(False, "needs an NVIDIA sm_90 GPU (Gluon has no interpreter)")
        if torch.cuda.get_device_capability(dev) != (9, 0):
            return Availability(False, "warpgroup MMAs and this TMA use are sm_90 only")
        try:
            import mla_tune.kernels.gluon.mla_decode  # noqa: F401 - defines the kernels
        except Exception as e:  # noqa: BLE001 - any import failure is the reason to report
            return Availability(False, f"kernels/gluon does not import: {type(e).__name__}: {e}")
        return Availability(True)

    def supports(self, shape: Shape) -> str | None:
        if shape.page_size != 1:
            return "reads contiguous caches only (no page table)"
        return None

    def feasible(self, shape: Shape, config: Mapping[str, Any]) -> bool:
        from mla_tune.kernels.gluon.launch import variant_feasible

        return variant_feasible(shape.kv_format.value, shape.kv_lens, shape.q_len,
                                shape.heads, shape.page_size, config)

    def precheck(self, shape: Shape, config: Mapping[str, Any],
                 device: torch.device) -> str | None:
        from mla_tune.kernels.gluon.compile import check

        return check(shape.kv_format.value, config)

    def build(self, shape: Shape, config: Mapping[str, Any], device: torch.device) -> KernelFn:
        from mla_tune.kernels.gluon.launch import build_variant

        return build_variant(shape.kv_format.value, list(shape.kv_lens), shape.q_len,
                             shape.heads, config, torch.device(device), SM_SCALE)

    def source_files(self) -> list[Path]:
        triton_dir = _KERNEL_DIR.parent / "triton"
        return [_KERNEL_DIR / "mla_decode.py", _KERNEL_DIR / "launch.py",
                triton_dir / "mla_decode.py", Path(__file__)]
