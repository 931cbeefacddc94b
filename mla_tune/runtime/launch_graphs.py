"""Replay a runner's launches from CUDA graphs keyed by the call's arguments.

On the GPU most of a serving step's host time is the driver's launch of each kernel, not
Python: measured on the H200 (bench/results/serving_loop.md), launching an empty kernel
costs about 5 µs of host time and the decode kernel with the GPU busy 8-9 µs, twice that
with a second-launch merge, while launching a graph of the same kernels costs about as
much as one empty kernel whatever it holds. And a serving loop calls a bucket's runner
with the same addresses step after step (graph-static buffers, or blocks the caching
allocator hands back), since the kernels read the step's lengths and page table from
device memory.

So `GraphedLaunch` wraps a launch function of integer arguments (addresses and scalars):
a call whose argument tuple is among the last `capacity` calls' captures its launches into
a graph, and later calls with the tuple launch the graph, which holds the same kernels with
the same arguments, so it does what the eager launch would do. Other calls launch eagerly:
a loop with fresh addresses every step, or cycling through more address sets than that,
pays no captures. At most `capacity` graphs are kept per runner (the oldest dropped
first); no device memory is taken from torch's allocator (the launches allocate nothing).
Callers call `launch` itself while the stream is capturing a graph of its own. A
capture that fails (a driver or stream state that refuses it) turns graphs off for the
runner (`off` says why) and the call launches eagerly: graphs never cost a call.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch

Capture = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]
"""Capture a launch callable: (a function that replays it, the callable's result)."""

GRAPHS_PER_RUNNER = 128
"""Argument tuples a runner keeps graphs of, and how many recent calls a repeat is looked
for in: a serving loop reuses one set of buffers, or alternates between a few, and a model
plans once per step and runs once per layer, each layer with its own pool and query (61
layers in DeepSeek-V3). A graph of one or two kernels holds no device memory of torch's."""


class GraphedLaunch:
    """`launch(*args)` replayed from a graph for argument tuples seen before (module
    docstring). `capture` captures one launch (default: a CUDA graph on `device`)."""

    def __init__(self, launch: Callable[..., Any], device: torch.device, *,
                 capacity: int = GRAPHS_PER_RUNNER, capture: Capture | None = None) -> None:
        self.launch = launch
        self.capacity = max(1, int(capacity))
        self._capture = capture or functools.partial(cuda_graph_capture, device=device)
        self._graphs: dict[tuple, tuple[Callable[[], None], Any]] = {}
        self._recent: dict[tuple, None] = {}
        """The argument tuples of recent eager calls, oldest first (a dict: O(1) lookups
        at any capacity)."""
        self.captures = 0
        """Graphs captured so far (each one costs one capture and instantiation)."""
        self.off = ""
        """Why graphs are off for this runner (a capture failed), or empty."""

    def __call__(self, *args: Any) -> Any:
        hit = self._graphs.get(args)
        if hit is not None:
            hit[0]()
            return hit[1]
        if self.off:
            return self.launch(*args)
        recent = self._recent
        if args not in recent:
            if len(recent) >= self.capacity:
                del recent[next(iter(recent))]
            recent[args] = None
            return self.launch(*args)
        del recent[args]
        if len(self._graphs) >= self.capacity:
            del self._graphs[next(iter(self._graphs))]
        launch = self.launch
        try:
            replay, result = self._capture(lambda: launch(*args))
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation; eager still runs
            self.off = f"capture failed: {type(e).__name__}: {e}"
            return launch(*args)
        self._graphs[args] = (replay, result)
        self.captures += 1
        replay()
        return result


@functools.cache
def _graph_launch() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuGraphLaunch.restype = ctypes.c_int
    return lib.cuGraphLaunch


def cuda_graph_capture(fn: Callable[[], Any], device: torch.device
                       ) -> tuple[Callable[[], None], Any]:
    """Capture `fn`'s launches into a CUDA graph on a side stream (nothing runs, nothing
    synchronizes) and return (a replay on the current stream, `fn`'s result). The replay
    calls the driver's graph launch directly: torch's `replay` adds its own bookkeeping
    to every call."""
    graph = torch.cuda.CUDAGraph()
    side = _side_stream(device)
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            result = fn()
        finally:
            graph.capture_end()
    handle = graph.raw_cuda_graph_exec()
    launch = _graph_launch()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream_of = torch._C._cuda_getCurrentRawStream

    def replay() -> None:
        rc = launch(handle, stream_of(index))
        if rc:
            raise RuntimeError(f"cuGraphLaunch failed with CUDA error {rc}")

    replay.graph = graph  # type: ignore[attr-defined]  # keeps the graph alive
    return replay, result


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


__all__ = ["GRAPHS_PER_RUNNER", "GraphedLaunch", "cuda_graph_capture"]
