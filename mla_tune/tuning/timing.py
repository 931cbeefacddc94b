"""Cold-L2 timing, following the leaderboard's protocol (problem.md, "Timing protocol").

Per timed call: run other kernels (`OTHER_KERNELS`, as the leaderboard's harness draws a
new input and checks the last output between two timed calls), synchronize, flush L2 by
writing a buffer at least twice its size, record a CUDA event, call, record an event,
synchronize. Repeat until the relative standard error of the mean is below a target or the
time budget is spent. Launch overhead and any per-call Python work are inside the timed
region on purpose: users are ranked on them too.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class TimingStats:
    """Summary of repeated timings, in microseconds."""

    median_us: float
    mean_us: float
    std_us: float
    min_us: float
    max_us: float
    n: int

    @property
    def rse(self) -> float:
        """Relative standard error of the mean."""
        if self.n < 2 or self.mean_us <= 0:
            return math.inf
        return self.std_us / math.sqrt(self.n) / self.mean_us

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(samples_us: list[float]) -> TimingStats:
    """Statistics of a list of samples (sample standard deviation)."""
    if not samples_us:
        raise ValueError("no timing samples")
    n = len(samples_us)
    mean = statistics.fmean(samples_us)
    std = statistics.stdev(samples_us) if n > 1 else 0.0
    return TimingStats(statistics.median(samples_us), mean, std, min(samples_us),
                       max(samples_us), n)


def _rse(samples: list[float]) -> float:
    """Relative standard error of the mean, as `TimingStats.rse`, in float arithmetic:
    the stop test runs after every sample, where `statistics.stdev`'s exact arithmetic
    cost ~0.3 ms at 500 samples (inside the time budget)."""
    n = len(samples)
    mean = math.fsum(samples) / n
    if n < 2 or mean <= 0:
        return math.inf
    var = math.fsum((x - mean) ** 2 for x in samples) / (n - 1)
    return math.sqrt(var) / math.sqrt(n) / mean


OTHER_KERNELS = "other-kernels"
NOTHING = "nothing"
BETWEEN_CALLS = (OTHER_KERNELS, NOTHING)
"""Conditions a timed call can start in. The leaderboard's harness draws a new input and
checks the last output between two timed calls; those kernels leave the SMs' instruction
and constant caches holding their code, which the L2 flush does not touch. On the H200 a
variant whose merge is a programmatic dependent launch took 30.6 us that way against 24.5
back to back (fp8 4x8192, bench/results/submission_export.md), so back-to-back times
ranked it first where the leaderboard does not."""


@dataclass(frozen=True)
class TimingPolicy:
    """When to stop repeating: enough samples and a small enough error, or budget spent."""

    warmup: int = 3
    min_runs: int = 20
    max_runs: int = 500
    target_rse: float = 0.001
    budget_s: float = 1.0
    between_calls: str = OTHER_KERNELS
    """What runs between two timed calls besides the L2 flush: OTHER_KERNELS (the
    leaderboard's condition) or NOTHING (back to back)."""

    def __post_init__(self) -> None:
        if self.between_calls not in BETWEEN_CALLS:
            raise ValueError(f"between_calls must be one of {', '.join(BETWEEN_CALLS)}, got "
                             f"{self.between_calls!r}")

    def done(self, samples: list[float], elapsed_s: float) -> bool:
        n = len(samples)
        if n >= self.max_runs:
            return True
        if n < self.min_runs:
            return elapsed_s > self.budget_s * 4 and n >= 3
        if elapsed_s >= self.budget_s:
            return True
        return _rse(samples) < self.target_rse


class Timer(Protocol):
    """Times a zero-argument callable and returns its statistics."""

    def measure(self, fn: Callable[[], Any]) -> TimingStats: ...

    def measure_interleaved(self, fns: Sequence[Callable[[], Any]]) -> list[TimingStats]: ...


INTERLEAVE_BLOCK = 8
"""Timed calls of one callable in a row, in an interleaved measurement (after one untimed
call): a kernel called right after others starts with its code out of the SMs' instruction
caches, which the L2 flush does not touch. On the H200, alternating call by call made
small-shape winners look 1.3-2.5x slower (4x1024 bf16: 14.1 -> 18.4 us), unlike the
leaderboard, which calls one kernel over and over."""


def _interleaved(policy: TimingPolicy, fns: Sequence[Callable[[], Any]],
                 sample: Callable[[Callable[[], Any]], float]) -> list[TimingStats]:
    """Samples of every callable in turn, INTERLEAVE_BLOCK at a time, until each has
    enough by `policy`; the budget is per callable. Side by side, a slow phase of the
    device (on an H200, seconds at a time 5-10 % slower for identical code) hits all of
    them alike. A single callable is simply sampled until done."""
    samples: list[list[float]] = [[] for _ in fns]
    budget = replace(policy, budget_s=policy.budget_s * len(fns))
    block = 1 if len(fns) == 1 else INTERLEAVE_BLOCK
    t0 = time.perf_counter()
    while not all(budget.done(xs, time.perf_counter() - t0) for xs in samples):
        for fn, xs in zip(fns, samples):
            if block > 1:
                sample(fn)  # untimed: its code back in the instruction caches
            xs.extend(sample(fn) for _ in range(block))
    return [summarize(xs) for xs in samples]


class OtherKernels:
    """The harness's work between two timed calls, in miniature: a random draw, a small
    float32 matrix product and an elementwise check with its reduction, on buffers of its
    own allocated once (nothing is allocated per call)."""

    def __init__(self, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.draw = torch.empty(1 << 20, dtype=torch.float32, device=device)
        self.a = torch.randn(256, 256, generator=gen, device=device)
        self.prod = torch.empty(256, 256, dtype=torch.float32, device=device)
        self.diff = torch.empty(256, 256, dtype=torch.float32, device=device)
        self.bad = torch.empty((), dtype=torch.float32, device=device)
        self.gen = gen

    def __call__(self) -> None:
        self.draw.normal_(generator=self.gen)
        torch.mm(self.a, self.a, out=self.prod)
        torch.sub(self.prod, self.a, out=self.diff)
        torch.abs(self.diff, out=self.diff)
        torch.amax(self.diff, out=self.bad)


class CudaTimer:
    """CUDA-event timer with an L2 flush before every call (after other kernels, as the
    policy's `between_calls` says)."""

    def __init__(self, device: torch.device, policy: TimingPolicy | None = None) -> None:
        self.device = torch.device(device)
        self.policy = policy or TimingPolicy()
        props = torch.cuda.get_device_properties(self.device)
        l2 = int(getattr(props, "L2_cache_size", 0)) or 64 * 2**20
        self.flush_bytes = max(2 * l2, 128 * 2**20)
        self._flush = torch.empty(self.flush_bytes // 4, dtype=torch.int32, device=self.device)
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._between = OtherKernels(self.device) \
            if self.policy.between_calls == OTHER_KERNELS else None

    def flush_l2(self) -> None:
        """Evict the L2 cache (queued on the current stream), so the next call starts cold."""
        self._flush.zero_()

    def sample(self, fn: Callable[[], Any]) -> float:
        """One timed call with a cold L2, in microseconds."""
        if self._between is not None:
            self._between()
        self.flush_l2()
        self._start.record()
        fn()
        self._end.record()
        torch.cuda.synchronize()
        return self._start.elapsed_time(self._end) * 1000.0

    def measure(self, fn: Callable[[], Any]) -> TimingStats:
        return self.measure_interleaved([fn])[0]

    def measure_interleaved(self, fns: Sequence[Callable[[], Any]]) -> list[TimingStats]:
        with torch.cuda.device(self.device):
            for fn in fns:
                for _ in range(self.policy.warmup):
                    fn()
            torch.cuda.synchronize()
            return _interleaved(self.policy, fns, self.sample)


class WallTimer:
    """Wall-clock timer for CPU runs: same API, no cache flush. Not a GPU figure."""

    def __init__(self, policy: TimingPolicy | None = None) -> None:
        self.policy = policy or TimingPolicy()

    @staticmethod
    def sample(fn: Callable[[], Any]) -> float:
        """One timed call, in microseconds."""
        s = time.perf_counter()
        fn()
        return (time.perf_counter() - s) * 1e6

    def measure(self, fn: Callable[[], Any]) -> TimingStats:
        return self.measure_interleaved([fn])[0]

    def measure_interleaved(self, fns: Sequence[Callable[[], Any]]) -> list[TimingStats]:
        for fn in fns:
            for _ in range(self.policy.warmup):
                fn()
        return _interleaved(self.policy, fns, self.sample)


def make_timer(device: str | torch.device, policy: TimingPolicy | None = None) -> Timer:
    """The right timer for `device`: CUDA events with cold L2 on a GPU, wall clock on CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaTimer(dev, policy)
    return WallTimer(policy)
