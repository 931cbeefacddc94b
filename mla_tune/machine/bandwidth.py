"""The device's measured streaming-read bandwidth: the roofline reports compare kernels with.

A datasheet figure (4.8 TB/s on an H200) is not reachable by any kernel; the best rate a
read-only kernel reaches on this device is the honest ceiling for memory-bound decode. It is
measured once per device and stored in the tuning DB (`TuningStore.set_read_bandwidth`).

Several readers are timed and the fastest counts: plain loads (a few block shapes),
`torch.sum`, and TMA tiles through a software-pipelined ring, the way the Triton MLA kernel
loads its cache (on an H200 the TMA reader is the fastest: bench/results/read_ceiling.md).
A ceiling below what the kernels reach would put them above 100 %. Each reader is timed as a
CUDA graph replay, so no host launch work is counted; one a device cannot run is skipped.
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
# TMA reader: (tile rows, pipeline stages, programs per SM) tried; rows of _TMA_WIDTH
# floats (1 KiB, the widest TMA box).
_TMA_CONFIGS = ((32, 3, 2), (32, 4, 2), (64, 3, 2), (32, 3, 3))
_TMA_WIDTH = 256
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


@triton.jit
def _tma_read_reduce_kernel(desc, partial_ptr, TILES: tl.constexpr, BM: tl.constexpr,
                            BW: tl.constexpr, STAGES: tl.constexpr):
    """Each program sums tiles [p * TILES, ...) of BM rows, loaded through TMA
    `STAGES` deep (`tl.range` pipelines them; a plain range would not), into one sum.
    Tiles past the end read as zeros (TMA fills out-of-bounds boxes)."""
    pid = tl.program_id(0)
    t0 = pid * TILES
    acc = tl.zeros([BM], dtype=tl.float32)
    for i in tl.range(0, TILES, num_stages=STAGES):
        acc += tl.sum(desc.load([(t0 + i) * BM, 0]), axis=1)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def tma_read_reduce(x: torch.Tensor, rows: int, stages: int, programs: int) -> torch.Tensor:
    """Partial sums of the flat float32 tensor `x` (a multiple of 256 elements), one per
    program, read as TMA tiles of `rows` x 256 floats: the timed read."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    x2 = x.view(-1, _TMA_WIDTH)
    tiles = triton.cdiv(x2.shape[0], rows)
    # At most 2**23 ones per program: its float32 sum stays exact (checked by the caller).
    programs = max(1, min(max(programs, triton.cdiv(x.numel(), 2**23)), tiles))
    partial = torch.empty(programs, dtype=torch.float32, device=x.device)
    desc = TensorDescriptor.from_tensor(x2, [rows, _TMA_WIDTH])
    _tma_read_reduce_kernel[(programs,)](desc, partial, TILES=triton.cdiv(tiles, programs),
                                         BM=rows, BW=_TMA_WIDTH, STAGES=stages, num_warps=4,
                                         num_stages=stages)
    return partial


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
    timed = _graphed(run)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best_ms = float("inf")
    for _ in range(repeats):
        start.record()
        timed()
        end.record()
        torch.cuda.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end))
    return nbytes / (best_ms * 1e-3) / 1e9


def _graphed(run: Callable[[], torch.Tensor]) -> Callable[[], object]:
    """`run` captured in a CUDA graph, returned as its replay: the host work of a launch
    (Triton's Python launch path, a TMA descriptor: tens of µs) is then not timed, which on
    a 1 ms read is a few percent of the rate. `run` itself where it cannot be captured."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        torch.cuda.synchronize()
    except RuntimeError:
        return run
    return graph.replay


def measure_read_bandwidth(device: str | torch.device, nbytes: int = DEFAULT_BYTES,
                           repeats: int = 10) -> float | None:
    """Best streaming-read rate of `device` in GB/s (1e9 bytes/s): the fastest of the
    readers of `reader_rates`; None on a CPU, where a wall-clock rate is not a roofline for
    GPU kernels."""
    rates = reader_rates(device, nbytes, repeats)
    return max(rates.values()) if rates else None


def reader_rates(device: str | torch.device, nbytes: int = DEFAULT_BYTES,
                 repeats: int = 10) -> dict[str, float]:
    """Best rate in GB/s of each reader that returned the right sum, read-reducing an
    all-ones buffer far larger than any cache; empty on a CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    with torch.cuda.device(dev):
        free, _ = torch.cuda.mem_get_info()
        n = min(nbytes, free // 4) // 4 // _GRANULE * _GRANULE
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        rates = _rates(torch.ones(n, dtype=torch.float32, device=dev), repeats, sms)
        torch.cuda.empty_cache()  # the buffer is gone with `_rates`; hand its memory back
    return rates


def _rates(x: torch.Tensor, repeats: int, sms: int) -> dict[str, float]:
    """Best rate of each read-reduce of the all-ones `x` that returned the right sum."""
    runs: dict[str, Callable[[], torch.Tensor]] = {
        f"loads BLOCK={b} ITERS={i} warps={w}": functools.partial(read_reduce, x, b, i, w)
        for b, i, w in _CONFIGS}
    runs["torch.sum"] = lambda: x.sum(dtype=torch.float64).view(1)
    runs.update({f"tma rows={r} stages={st} programs={p * sms}":
                 functools.partial(tma_read_reduce, x, r, st, p * sms)
                 for r, st, p in _TMA_CONFIGS})
    rates = {}
    for name, run in runs.items():
        try:
            rate = _best_gbps(run, x.numel() * 4, float(x.numel()), repeats)
        except (RuntimeError, ValueError, triton.TritonError):
            continue  # a reader this GPU cannot compile or run is simply not a candidate
        if rate is not None:
            rates[name] = rate
    return rates
