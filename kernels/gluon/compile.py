"""Cross-compile Gluon kernels for sm_90a without a GPU, and the family's static check.

Gluon kernels compile through `GluonASTSource` (layouts are part of the source, so the
module carries the target's warp count from the start); otherwise as
kernels/triton/precompile.py compiles Triton kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..triton.static_check import spill_sites
from . import mla_decode as gm
from .launch import FORMATS, SMEM_LIMIT

TARGET = ("cuda", 90, 32)


def compile_kernel(fn: Any, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """`fn` compiled for sm_90a as a launch with `args` (pointers as torch dtypes, host
    descriptors as objects) and `kwargs` (constexprs, num_warps) would compile it."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import MockTensor, create_function_from_signature

    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*map(MockTensor.wrap_dtype, args), **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization,
                                                          options)
    src = GluonASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


_CACHE_DTYPES = {"bf16": (torch.bfloat16, 576), "fp8": (torch.float8_e4m3fn, 576),
                 "mxfp4": (torch.uint8, 288)}


@functools.cache
def compile_variant(kv_format: str, rows: int, warps: int, stages: int, bufs: int) -> Any:
    """The split kernel of one compiled point, for sm_90a."""
    dtype, width = _CACHE_DTYPES[kv_format]
    cache = torch.empty((64, width), dtype=dtype)
    descs = gm.descriptors(kv_format, cache, 64)
    f32, i32 = torch.float32, torch.int32
    args = (torch.bfloat16, *descs, f32, torch.uint8, 24, i32, i32, torch.bfloat16, f32, f32,
            16, 4096, 2, 0.1)
    return compile_kernel(gm.mla_decode_gluon_kernel, args,
                          {"FMT": FORMATS[kv_format], "ROWS": rows, "STAGES": stages,
                           "BUFS": bufs, "num_warps": warps})


def check(kv_format: str, config: Mapping[str, Any]) -> str | None:
    """Why the point should not reach the GPU (shared memory over the limit, register
    spills), or None."""
    k = compile_variant(kv_format, int(config["rows"]), int(config["warps"]),
                        int(config["stages"]), int(config["bufs"]))
    if k.metadata.shared > SMEM_LIMIT:
        return f"needs {k.metadata.shared} B of shared memory (sm_90: {SMEM_LIMIT})"
    spills, _ = spill_sites(k.asm["cubin"])
    if spills:
        return f"{spills} register spill instructions on sm_90a"
    return None
