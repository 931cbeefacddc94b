"""A Triton variant from a point of its tuning space: the launch rules of the Triton family.

`variant_feasible` (which points can run a shape: shape arithmetic, no launch, no compile),
`variant_config` (the kernel's KernelConfig of a point) and `build_variant` (a prepared
launcher as `run(data) -> output` on the task tuple) take plain values (format name, kv
lengths, the config dict). `mla_tune.backends.triton_family` delegates its `feasible`,
`kernel_config` and `build` to them, and the one-file leaderboard submission (`mla-tune
export --submission`) carries this file next to mla_decode.py, so a tuned config runs the
same kernel both ways. Like every file of kernels/, it imports nothing of mla_tune.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .mla_decode import KernelConfig, MlaDecodeLauncher

COMPUTE_BY_FORMAT = {"bf16": ("bf16",), "fp8": ("bf16", "fp16", "fp8", "fp8qk"),
                     "mxfp4": ("bf16",)}
"""Compute paths that make sense per KV format (bf16 KV is not re-quantized; MXFP4 blocks
scales along the head dim, so only bf16 holds the decoded values exactly)."""

WARPS_FOR_BLOCK_M = {16: 4, 32: 8, 64: 8, 128: 8}
"""The accumulator is 512 x block_m float32: 32 or more rows need two warpgroups to stay in
registers (sm_90 static check: 32 rows on 4 warps spill), 16 rows fit one (measured on
H200: 8 warps at 16 rows was 1.3-1.7x slower)."""

MXFP4_SCALE_STRIDE = 24
"""Row stride of the MXFP4 scale tensor as aiter pads it: 24 bytes, 18 used."""


def variant_page_size(page_size: int, config: Mapping[str, Any]) -> int:
    """A paged shape is read with its own page size; the knob applies to contiguous ones."""
    return page_size if page_size > 1 else int(config["page_size"])


def variant_feasible(kv_format: str, kv_lens: tuple[int, ...], q_len: int, heads: int,
                     page_size: int, config: Mapping[str, Any]) -> bool:
    """Whether the config can run the shape (shape arithmetic only: no launch, no
    compile); the Triton family's `feasible`."""
    if str(config["compute"]) not in COMPUTE_BY_FORMAT[kv_format]:
        return False
    block_m, block_n = int(config["block_m"]), int(config["block_n"])
    if WARPS_FOR_BLOCK_M.get(block_m) != int(config["num_warps"]):
        return False
    if block_m > 16 and block_m >= 2 * q_len * heads:
        return False  # half the rows or more would be padding
    if block_m > 16 and (block_n != 64 or (kv_format == "fp8" and (
            str(config["compute"]) in ("bf16", "fp16")
            or str(config.get("kv_load", "pointer")) != "pointer"
            or str(config.get("fp8_convert", "staged")) != "staged"))):
        return False  # see block_m in configs/backends/triton.toml
    if not bool(config.get("pdl", True)) and (
            bool(config["fast_mode"]) or int(config["num_splits"]) == 1):
        return False  # no second launch to make plain: see pdl in configs/backends/triton.toml
    if page_size > 1 and int(config["page_size"]) != 1:
        return False  # paged shapes use their own page size; avoid duplicate points
    # fp8 KV converted for the MMAs (fp8qk converts the values, to fp16).
    converts_fp8 = kv_format == "fp8" and str(config["compute"]) != "fp8"
    if not converts_fp8 and str(config.get("fp8_convert", "staged")) != "staged":
        return False  # the knob only exists for fp8 KV on 16-bit MMAs
    kv_load = str(config.get("kv_load", "pointer"))
    if kv_load in ("tma", "tma_host") and (
            variant_page_size(page_size, config) > 1 or not (
                kv_format == "bf16" or (kv_format == "fp8" and str(config["compute"]) == "fp8"))):
        return False  # see kv_load in configs/backends/triton.toml
    if kv_load == "tma_host" and (q_len != 1 or any(L % block_n for L in kv_lens)):
        return False  # shared descriptors: mla_decode.tiles_stay_inside must hold
    return int(config["num_splits"]) * block_n <= max(kv_lens)


def variant_config(kv_format: str, page_size: int, config: Mapping[str, Any]) -> KernelConfig:
    """The kernel's KernelConfig for a point of the space."""
    return KernelConfig(
        kv_format=kv_format, compute=str(config["compute"]),
        block_m=int(config["block_m"]), block_n=int(config["block_n"]),
        num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"]),
        num_splits=int(config["num_splits"]),
        page_size=variant_page_size(page_size, config),
        fast_mode=bool(config["fast_mode"]),
        fp8_convert=str(config.get("fp8_convert", "staged")),
        kv_load=str(config.get("kv_load", "pointer")), pdl=bool(config.get("pdl", True)))


def build_variant(kv_format: str, kv_lens: list[int], q_len: int, heads: int,
                  config: Mapping[str, Any], device: torch.device, page_size: int = 1,
                  sm_scale: float = 1.0 / math.sqrt(576)) -> Callable[[tuple], torch.Tensor]:
    """A prepared launcher of the config for the shape, as `run(data) -> output` on the
    task tuple. The output tensor is the launcher's, overwritten by the next call."""
    launcher = MlaDecodeLauncher(variant_config(kv_format, page_size, config), heads=heads,
                                 q_len=q_len, kv_lens=list(kv_lens), device=device,
                                 sm_scale=sm_scale)
    launcher.prepare(sc_stride=MXFP4_SCALE_STRIDE if kv_format == "mxfp4" else 0)
    if kv_format == "bf16":
        def run(data: tuple) -> torch.Tensor:
            return launcher(data[0], data[1]["bf16"], None, None, data[2], data[3])
    elif kv_format == "fp8":
        def run(data: tuple) -> torch.Tensor:
            kv, scale = data[1]["fp8"]
            return launcher(data[0], kv, scale, None, data[2], data[3])
    else:
        u8 = torch.uint8

        def run(data: tuple) -> torch.Tensor:
            kv, scale = data[1]["mxfp4"]
            if kv.dtype != u8:  # float4_e2m1fn_x2 storage: same bytes
                kv = kv.view(u8)
            if scale.dtype != u8:  # float8_e8m0fnu storage: same bytes
                scale = scale.view(u8)
            return launcher(data[0], kv, None, scale, data[2], data[3])
    return run
