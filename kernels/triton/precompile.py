"""Compile a Triton kernel for a GPU target exactly as its JIT would at launch, without a GPU.

`triton.compile` keys its on-disk cache by the kernel source, the argument specialization
(types, 16-byte alignment, integers equal to 1 or divisible by 16), the options and the
target. A launch (or `warmup`) on a GPU computes that key from its arguments; computing it
here the same way, through the JIT's own binder, makes a compile done in a CPU process the
very cache entry a GPU process later loads instead of compiling. Several GPU workers of one
sweep then share one compile of each variant (issue 6), and the static check inspects the
binary that actually runs.

This uses two helpers of `triton.runtime.jit` that are not public API
(`create_function_from_signature`, `JITFunction._pack_args`); the project pins Triton, and
tests/kernels/test_precompile.py fails if their behaviour changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TARGETS = {
    "cuda:90": ("cuda", 90, 32),
    "hip:gfx950": ("hip", "gfx950", 64),
}
"""Targets the project cross-compiles for: NVIDIA Hopper and AMD MI355X."""


def target_for_arch(arch: str) -> str | None:
    """Our target name for a device fingerprint's arch ('sm_90' -> 'cuda:90',
    'gfx950' -> 'hip:gfx950'), or None for a device we cannot compile for."""
    if arch.startswith("sm_"):
        name = f"cuda:{arch[3:]}"
    else:
        name = f"hip:{arch}"
    return name if name in TARGETS else None


def jit_compile(fn: Any, target: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """Compile `fn` for `target` as `fn.warmup(*args, grid=..., **kwargs)` would on a device
    of that target, and return the compiled kernel. Pointer arguments may be given as torch
    dtypes (assumed 16-byte aligned, as `warmup` assumes). Gluon kernels compile through
    their own source class (their layouts need the target's warp count from the start)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    gpu_target = GPUTarget(*TARGETS[target])
    backend = make_backend(gpu_target)
    # The options JITFunction.run adds before binding.
    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*map(MockTensor.wrap_dtype, args), **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization,
                                                          options)
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    src = source(fn, signature, constexprs, attrs)
    return triton.compile(src, target=gpu_target, options=options.__dict__)
