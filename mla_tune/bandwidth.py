"""The device's measured streaming-read bandwidth: the roofline reports compare kernels with.

A datasheet figure (4.8 TB/s on an H200) is not reachable by any kernel; the best rate a
read-only kernel reaches on this device is the honest ceiling for memory-bound decode. It is
measured once per device and stored in the tuning DB (`TuningStore.set_read_bandwidth`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

DEFAULT_BYTES = 4 * 2**30
# (BLOCK, ITERS, num_warps) tried; the best one is the ceiling. BLOCK * ITERS ones summed
# in float32 stay exact (<= 2**24), which is how each launch is checked.
_CONFIGS = ((4096, 16, 8), (8192, 8, 8), (2048, 32, 4))
# Buffer length granule: a multiple of 16 lets Triton specialize `n` and vectorize the
# masked loads (16-byte loads, checked in the sm_90 PTX and gfx950 assembly).
_GRANULE = 65536


@triton.jit
def _read_reduce_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program sums BLOCK * ITERS consecutive floats into one partial sum."""
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_reduce(x: torch.Tensor, block: int, iters: int, num_warps: int) -> torch.Tensor:
    """Partial sums of the flat float32 tensor `x`, one per program: the timed read."""
    n = x.numel()
    programs = triton.cdiv(n, block * iters)
    partial = torch.empty(programs, dtype=torch.float32, device=x.device)
    _read_reduce_kernel[(programs,)](x, partial, n, BLOCK=block, ITERS=iters,
                                     num_warps=num_warps)
    return partial


def _best_gbps(run: Callable[[], torch.Tensor], nbytes: int, expected: float,
               repeats: int) -> float | None:
    """Best bandwidth of `repeats` timed calls of `run() -> tensor of sums`, or None when
    its result is wrong (a kernel that skipped reads would report an absurd rate)."""
    result = run()  # warm-up: compiles, and checks the sum
    torch.cuda.synchronize()
    if float(result.double().sum()) != expected:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best_ms = float("inf")
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end))
    return nbytes / (best_ms * 1e-3) / 1e9


def measure_read_bandwidth(device: str | torch.device, nbytes: int = DEFAULT_BYTES,
                           repeats: int = 5) -> float | None:
    """Best streaming-read rate of `device` in GB/s (1e9 bytes/s), read-reducing a buffer
    far larger than any cache with our Triton kernel (a few block shapes) and `torch.sum`;
    None on a CPU, where a wall-clock rate is not a roofline for GPU kernels."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    with torch.cuda.device(dev):
        free, _ = torch.cuda.mem_get_info()
        n = min(nbytes, free // 4) // 4 // _GRANULE * _GRANULE
        rates = _rates(torch.ones(n, dtype=torch.float32, device=dev), repeats)
        torch.cuda.empty_cache()  # the buffer is gone with `_rates`; hand its memory back
    return max(rates) if rates else None


def _rates(x: torch.Tensor, repeats: int) -> list[float]:
    """Best rate of each read-reduce of the all-ones `x` that returned the right sum."""
    runs: list[Callable[[], torch.Tensor]] = [
        functools.partial(read_reduce, x, b, i, w) for b, i, w in _CONFIGS]
    runs.append(lambda: x.sum(dtype=torch.float64).view(1))
    rates = []
    for run in runs:
        try:
            rate = _best_gbps(run, x.numel() * 4, float(x.numel()), repeats)
        except (RuntimeError, triton.TritonError):
            continue  # a block shape this GPU cannot compile is simply not a candidate
        if rate is not None:
            rates.append(rate)
    return rates
