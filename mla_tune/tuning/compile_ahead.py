"""The compile stage of a sweep: each distinct kernel of its candidates is compiled once, in
CPU processes, while the GPU workers start.

Without it every GPU worker compiled every variant it met, so a second GPU repeated the
first one's compile work instead of sharing it (issue 6: `--gpus 2` gained only 1.2x). A
backend says which candidates share a compile (`Backend.compile_key`) and how to compile
one into the on-disk caches its `precheck` and `build` read (`Backend.compile_ahead`); the
GPU workers then load compiled kernels.

The stage only speeds a sweep up: a compile that fails, crashes its process or hangs is
left to the GPU worker, which compiles (or fails) the candidate itself and records the
outcome as a trial. Compile processes are the sweep's worker processes on `cpu` slots, so
a crashing compiler is contained and replaced the same way a crashing kernel is.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mla_tune.backends import Backend, get_backend
from mla_tune.machine.fingerprint import current_device
from mla_tune.problem.probes import probe_shapes
from mla_tune.problem.shapes import Shape
from mla_tune.tuning.timing import TimingPolicy
from mla_tune.tuning.workers import WorkerContext, WorkerPool

log = logging.getLogger(__name__)
# Compile processes a GPU sweep starts before it knows how many kernels it has: enough for
# one format's default Triton space (4 kernels) twice over.
MAX_PRELAUNCHED = 8


@dataclass(frozen=True)
class CompileJob:
    """Compile the kernels of one candidate for a GPU of `arch`; plain data, so it crosses
    the process boundary. Its result is None, or the error text of a failed compile."""

    backend: str
    shape: dict[str, Any]
    config: dict[str, Any]
    arch: str

    def run(self, ctx: WorkerContext) -> str | None:
        try:
            get_backend(self.backend).compile_ahead(Shape.from_json(self.shape), self.config,
                                                    self.arch)
        except Exception as exc:  # noqa: BLE001 - the GPU worker meets it again and records it
            return f"{type(exc).__name__}: {exc}"[:500]
        return None

    def lost(self, status: str, cause: str) -> str:
        return f"{status}: {cause}"


@dataclass
class CompileSummary:
    """What the compile stage did: kernels compiled, failures, and how long it took."""

    kernels: int = 0
    compiled: int = 0
    failed: list[str] = field(default_factory=list)
    unfinished: int = 0
    processes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class CompileTask:
    """One distinct compiled kernel of a sweep: a candidate that stands for all candidates
    of its backend with the same `compile_key`."""

    backend: str
    shape: Shape
    config: dict[str, Any]


def plan_compiles(shapes: Sequence[Shape], backends: Sequence[Backend], device: torch.device,
                  pins: Mapping[str, Mapping[str, list[Any]]] | None = None
                  ) -> list[CompileTask]:
    """One task per distinct compiled kernel among the candidates of `shapes` and of the
    probe batches each candidate is also checked on (mla_tune.problem.probes), in shape
    order (the first shapes' kernels are ready first)."""
    tasks: list[CompileTask] = []
    seen: set[tuple[str, Hashable]] = set()
    for shape in shapes:
        probes = probe_shapes(shape)
        for backend in backends:
            if backend.supports(shape):
                continue
            for config in backend.candidates(shape, device, (pins or {}).get(backend.name)):
                for s in (shape, *(p for p in probes if not backend.supports(p)
                                   and backend.feasible(p, config))):
                    key = backend.compile_key(s, config, device)
                    if key is None or (backend.name, key) in seen:
                        continue
                    seen.add((backend.name, key))
                    tasks.append(CompileTask(backend.name, s, dict(config)))
    return tasks


def default_processes(jobs: int, gpu_workers: int) -> int:
    """Compile processes: one per job, leaving a core to the driver and each GPU worker."""
    cores = os.cpu_count() or 1
    return max(1, min(jobs, cores - 1 - gpu_workers))


def run_compiles(tasks: Sequence[CompileTask], arch: str, pool: WorkerPool,
                 job_limit_s: float, cancel: threading.Event | None = None) -> CompileSummary:
    """Compile `tasks` for a GPU of `arch` on `pool`, a pool of CPU worker processes that
    have the sweep's backends registered. A compile over `job_limit_s` seconds has its
    process killed and is left to the GPU workers; setting `cancel` stops the stage."""
    summary = CompileSummary(kernels=len(tasks), processes=pool.size)
    start = time.monotonic()
    todo = [CompileJob(t.backend, t.shape.to_json(), t.config, arch) for t in tasks]
    pool.launch()
    while (todo or pool.busy) and pool.alive and not (cancel and cancel.is_set()):
        for slot in pool.idle():
            if not todo:
                break
            pool.submit(slot, todo.pop(0), job_limit_s)
        for done in pool.wait(0.5):
            if done.result is None:
                summary.compiled += 1
            else:
                summary.failed.append(f"{done.job.backend} {done.job.config}: {done.result}")
    summary.unfinished = len(todo) + pool.busy
    summary.seconds = time.monotonic() - start
    return summary


class CompileStage:
    """The compile stage on a background thread: planning, the CUDA query for the target
    arch and the compiles overlap the sweep's own start-up (workers starting, library
    versions, the DB); `join` before the first candidate is timed.

    For a GPU sweep with a backend that compiles ahead, the compile processes are started
    at once, before planning (starting a process that imports torch takes seconds, planning
    a fraction of that); otherwise they start only when there is something to compile."""

    def __init__(self, shapes: Sequence[Shape], backends: Sequence[Backend],
                 device: torch.device, pins: Mapping[str, Mapping[str, list[Any]]],
                 paths: Mapping[str, str], gpu_workers: int, job_limit_s: float) -> None:
        self._shapes, self._backends = list(shapes), list(backends)
        self._device, self._pins, self._paths = torch.device(device), dict(pins), dict(paths)
        self._gpu_workers, self._job_limit_s = gpu_workers, job_limit_s
        self._pool: WorkerPool | None = None
        self._cancel = threading.Event()
        self._summary: CompileSummary | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mla-tune-compile",
                                        daemon=True)

    def start(self) -> None:
        compiles = any(type(b).compile_key is not Backend.compile_key for b in self._backends)
        if self._gpu_workers and compiles:
            self._pool = self._new_pool(MAX_PRELAUNCHED)
            self._pool.launch()
        self._thread.start()

    def join(self) -> CompileSummary:
        """Wait for the stage; re-raises its error (a bug: compile failures are data)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._summary is not None
        return self._summary

    def cancel(self) -> None:
        """Stop compiling (its processes are killed) and wait for the thread."""
        self._cancel.set()
        self._thread.join()

    def _new_pool(self, jobs: int) -> WorkerPool:
        n = default_processes(jobs, self._gpu_workers)
        return WorkerPool(["cpu"] * n, self._paths, TimingPolicy(), seed=0)

    def _run(self) -> None:
        try:
            tasks = plan_compiles(self._shapes, self._backends, self._device, self._pins)
            if not tasks:
                self._summary = CompileSummary()
                return
            if self._pool is None:
                self._pool = self._new_pool(len(tasks))
                self._pool.launch()
            arch = current_device(self._device).arch
            self._summary = run_compiles(tasks, arch, self._pool, self._job_limit_s,
                                         self._cancel)
            log.debug("compile stage: %d of %d kernels in %.1f s", self._summary.compiled,
                      self._summary.kernels, self._summary.seconds)
        except BaseException as exc:  # noqa: BLE001 - handed to the sweep's thread by join
            self._error = exc
        finally:
            if self._pool is not None:
                self._pool.close()


__all__ = ["CompileJob", "CompileStage", "CompileSummary", "CompileTask", "default_processes",
           "plan_compiles", "run_compiles"]
