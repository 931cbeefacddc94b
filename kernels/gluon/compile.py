"""The Gluon family's kernels cross-compiled for sm_90a without a GPU
(kernels/triton/precompile.py's `jit_compile`), and its static check."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..triton.precompile import jit_compile
from ..triton.static_check import SHARED_LIMIT, spill_sites
from . import mla_decode as gm
from . import mla_decode_ws as gws
from .launch import FORMATS, ws_maxnreg

_CACHE_DTYPES = {"bf16": (torch.bfloat16, 576), "fp8": (torch.float8_e4m3fn, 576),
                 "mxfp4": (torch.uint8, 288)}


@functools.cache
def compile_variant(kv_format: str, rows: int, warps: int, stages: int, bufs: int,
                    ws: int = 0) -> Any:
    """The split kernel of one compiled point, for sm_90a (`ws` > 0: the warp-specialized
    one with that many decoding warps)."""
    dtype, width = _CACHE_DTYPES[kv_format]
    cache = torch.empty((64, width), dtype=dtype)
    descs = gm.descriptors(kv_format, cache, 64)
    f32, i32 = torch.float32, torch.int32
    args = (torch.bfloat16, *descs, f32, torch.uint8, 24, i32, i32, torch.bfloat16, f32, f32,
            16, 4096, 2, 0.1)
    opts = {"FMT": FORMATS[kv_format], "ROWS": rows, "STAGES": stages, "BUFS": bufs,
            "num_warps": warps}
    if ws:
        return jit_compile(gws.mla_decode_gluon_ws_kernel, "cuda:90", args,
                           dict(opts, DW=ws, maxnreg=ws_maxnreg(ws)))
    return jit_compile(gm.mla_decode_gluon_kernel, "cuda:90", args, opts)


def check(kv_format: str, config: Mapping[str, Any]) -> str | None:
    """Why the point should not reach the GPU (shared memory over the limit, register
    spills), or None."""
    k = compile_variant(kv_format, int(config["rows"]), int(config["warps"]),
                        int(config["stages"]), int(config["bufs"]), int(config.get("ws", 0)))
    limit = SHARED_LIMIT["cuda:90"]
    if k.metadata.shared > limit:
        return f"needs {k.metadata.shared} B of shared memory (sm_90: {limit})"
    spills, _ = spill_sites(k.asm["cubin"])
    if spills:
        return f"{spills} register spill instructions on sm_90a"
    return None
