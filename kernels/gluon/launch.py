"""Launch rules of the Gluon Hopper family: which points of its space run a shape, and a
built launcher (`build_variant`: `run(data) -> output` on the task tuple).

Like every file of kernels/, it imports nothing of mla_tune.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton

from ..triton import mla_decode as tmd
from ..triton.static_check import SHARED_LIMIT
from . import mla_decode as gm
from . import mla_decode_ws as gws

SMEM_LIMIT = SHARED_LIMIT["cuda:90"]

FORMATS = {"bf16": gm.FMT_BF16, "fp8": gm.FMT_FP8, "mxfp4": gm.FMT_MXFP4}


def ws_maxnreg(decode_warps: int) -> int:
    """Registers per thread a warp-specialized program launches with: its 4 MMA warps, 1 TMA
    warp and the decoding warps, counted in whole warpgroups, within an SM's 65536 (4
    decoding warps: 3 warpgroups, 168; 8: 4, 128). The partitions then trade registers."""
    groups = 1 + triton.cdiv(1 + decode_warps, 4)
    return 65536 // (128 * groups) // 8 * 8


def smem_bytes(kv_format: str, rows: int, stages: int, bufs: int) -> int:
    """Shared memory of one program (kernel layout, barriers aside): Q and P parts, the
    bf16 operand buffers (bf16: the TMA ring) and the raw byte ring of fp8/MXFP4."""
    part = 64 * 576 * 2
    q_and_p = rows * 576 * 2 + rows * 64 * 2
    if kv_format == "bf16":
        return q_and_p + stages * part
    raw = 64 * (576 if kv_format == "fp8" else 288)
    return q_and_p + bufs * part + stages * raw


def variant_feasible(kv_format: str, kv_lens: tuple[int, ...], q_len: int, heads: int,
                     page_size: int, config: Mapping[str, Any]) -> bool:
    """Whether the point can run the shape (arithmetic only): contiguous caches, shared
    memory within the limit, a row block no larger than the rows it serves (save 16),
    splits of at least one 64-key tile, and knobs that mean something for the format."""
    rows, stages, bufs = int(config["rows"]), int(config["stages"]), int(config["bufs"])
    if page_size != 1 or kv_format not in FORMATS:
        return False
    if int(config.get("ws", 0)) and (kv_format != "mxfp4" or int(config["warps"]) != 4
                                     or bufs != 2 or int(config["ws"]) not in (4, 8)):
        return False  # MXFP4 decoding warps two buffers ahead of one MMA warpgroup
    if kv_format == "bf16" and bufs != 1:
        return False  # bf16 tiles are read where TMA puts them
    if smem_bytes(kv_format, rows, stages, bufs) > SMEM_LIMIT - 1024:
        return False
    if rows > max(16, q_len * heads) or (rows // 8) % (int(config["warps"]) // 4):
        return False
    splits = int(config["splits"])
    return splits <= 1 or splits * 64 <= max(kv_lens)


def auto_splits(batch: int, row_blocks: int, max_kv: int, num_sms: int) -> int:
    """Splits per sequence for about one program per SM (one fits an SM's shared memory),
    no more than its 64-key tiles."""
    want = triton.cdiv(num_sms, batch * row_blocks)
    return max(1, min(want, triton.cdiv(max_kv, 64), 64))


class GluonLauncher:
    """One variant built for a shape: output, partial buffers and grid made once; the TMA
    descriptors remade only when the cache tensor changes."""

    def __init__(self, kv_format: str, heads: int, q_len: int, kv_lens: list[int],
                 config: Mapping[str, Any], device: torch.device, sm_scale: float) -> None:
        self.fmt = kv_format
        self.heads = heads
        self.rows = int(config["rows"])
        self.warps = int(config["warps"])
        self.stages = int(config["stages"])
        self.bufs = int(config["bufs"])
        self.ws = int(config.get("ws", 0))
        batch = len(kv_lens)
        self.row_blocks = triton.cdiv(q_len * heads, self.rows)
        splits = int(config["splits"])
        if splits == 0:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            splits = auto_splits(batch, self.row_blocks, max(kv_lens), sms)
        self.splits = splits
        self.grid = (self.row_blocks, splits, batch)
        total_q = batch * q_len
        self.total_rows = total_q * heads
        self.out = torch.empty((total_q, heads, 512), dtype=torch.bfloat16, device=device)
        self.part_o = torch.empty((max(splits, 1) * self.total_rows, 512), dtype=torch.float32,
                                  device=device)
        self.part_lse = torch.empty((max(splits, 1) * self.total_rows,), dtype=torch.float32,
                                    device=device)
        self.ones = torch.ones(1, dtype=torch.float32, device=device)
        self.no_scales = torch.zeros(1, dtype=torch.uint8, device=device)
        self.qk_scale = sm_scale * tmd.LOG2E
        self._descs: tuple[int, tuple] | None = None

    def _descriptors(self, kv: torch.Tensor) -> tuple:
        key = (kv.data_ptr(), kv.shape[0])
        if self._descs is None or self._descs[0] != key:
            self._descs = (key, gm.descriptors(self.fmt, kv, kv.shape[0]))
        return self._descs[1]

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 scales: torch.Tensor | None, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor) -> torch.Tensor:
        sc = scales if scales is not None else self.no_scales
        kernel = gws.mla_decode_gluon_ws_kernel if self.ws else gm.mla_decode_gluon_kernel
        extra = {"maxnreg": ws_maxnreg(self.ws), "DW": self.ws} if self.ws else {}
        kernel[self.grid](
            q, *self._descriptors(kv), kv_scale if kv_scale is not None else self.ones, sc,
            scales.stride(0) if scales is not None else 0, qo_indptr, kv_indptr, self.out,
            self.part_o, self.part_lse, self.heads, self.total_rows, self.splits,
            self.qk_scale, FMT=FORMATS[self.fmt], ROWS=self.rows, STAGES=self.stages,
            BUFS=self.bufs, num_warps=self.warps, **extra)
        if self.splits > 1:
            tmd.mla_merge_kernel[(self.row_blocks, self.grid[2], tmd.MERGE_CHUNKS.value)](
                qo_indptr, kv_indptr, self.part_o, self.part_lse, self.out, self.heads,
                self.total_rows, self.splits, BLOCK_M=self.rows, BLOCK_N=64, PDL=False,
                num_warps=4, num_stages=1)
        return self.out


def task_args(kv_format: str, data: tuple) -> tuple:
    """The task tuple as GluonLauncher takes it: (q, cache, fp8 scale, MXFP4 scales,
    qo_indptr, kv_indptr); MXFP4's packed cache as bytes."""
    q, kv_data, qo, kvp, _ = data
    if kv_format == "bf16":
        return q, kv_data["bf16"], None, None, qo, kvp
    if kv_format == "fp8":
        kv, scale = kv_data["fp8"]
        return q, kv, scale, None, qo, kvp
    kv, scales = kv_data["mxfp4"]
    return q, kv.view(torch.uint8), None, scales, qo, kvp


def build_variant(kv_format: str, kv_lens: list[int], q_len: int, heads: int,
                  config: Mapping[str, Any], device: torch.device,
                  sm_scale: float) -> Callable[[tuple], torch.Tensor]:
    """The built launcher of a point, as `run(data) -> output` on the task tuple."""
    launcher = GluonLauncher(kv_format, heads, q_len, kv_lens, config, device, sm_scale)

    def run(data: tuple) -> torch.Tensor:
        return launcher(*task_args(kv_format, data))

    return run
