"""Worker processes that build, verify and time candidates, one per device slot.

A kernel variant can kill its process (illegal memory access, segfault, `os._exit`, the
OOM killer), hang, or leave a CUDA context unusable. None of that may stop a sweep, so the
driver process never runs a kernel: each worker is a spawned process pinned to one device
(`cuda:i` or `cpu`) that caches the task input and reference per shape and runs jobs sent
over a pipe. The pool enforces a wall-clock limit per job, turns a dead or overdue worker's
job into a `failed` / `timeout` result naming the cause, and starts a replacement.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

import torch

from mla_tune.backends import get_backend, register
from mla_tune.machine.fingerprint import DeviceFingerprint, current_device
from mla_tune.problem.probes import probe_shapes
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import KVFormat, Shape, TaskInput, generate_input
from mla_tune.problem.verify import Tolerance, tolerance_for
from mla_tune.tuning.evaluate import (
    MAX_ERROR_CHARS,
    Contender,
    Probe,
    TrialOutcome,
    evaluate,
    evaluate_together,
)
from mla_tune.tuning.timing import Timer, TimingPolicy, make_timer

log = logging.getLogger(__name__)
# Spawning imports torch and initializes the device; allow for a loaded machine.
START_TIMEOUT_S = 300.0
# Consecutive failed starts of one slot before the slot is given up.
MAX_START_FAILURES = 3
# Characters of a dead worker's own output kept in the recorded cause.
LOG_TAIL_CHARS = 1500
_PR_SET_PDEATHSIG = 1


class WorkerPoolError(RuntimeError):
    """No worker could be started; the message carries the last worker's error."""


class WorkerContext:
    """What a worker keeps between jobs: its device, a timer, and the input and reference
    of the shape it saw last and of its probe batches (generating them once per shape, not
    once per candidate)."""

    def __init__(self, device: str, policy: TimingPolicy, seed: int) -> None:
        self.device = torch.device(device)
        self.seed = seed
        self.timer: Timer = make_timer(self.device, policy)
        self._shape_key: str | None = None
        self._inputs: tuple[TaskInput, torch.Tensor, Tolerance] | None = None
        self._probes: tuple[Probe, ...] | None = None

    def inputs(self, shape: Shape) -> tuple[TaskInput, torch.Tensor, Tolerance]:
        """Task input, float32 reference and tolerance of `shape` (only one shape is kept,
        so a long sweep does not pile up device memory)."""
        if self._shape_key != shape.key or self._inputs is None:
            self._inputs, self._probes, self._shape_key = None, None, None
            self.free_memory()
            data = generate_input(shape, seed=self.seed, device=self.device)
            ref = mla_decode_reference(*data, kv_format=shape.kv_format.value)
            self._inputs = data, ref, tolerance_for(shape.kv_format)
            self._shape_key = shape.key
        return self._inputs

    def probes(self, shape: Shape) -> tuple[Probe, ...]:
        """The probe batches of `shape` with their inputs and references, made on the first
        trial that needs them (a run-off or warm-up never does)."""
        self.inputs(shape)
        if self._probes is None:
            probes = []
            for p in probe_shapes(shape):
                data = generate_input(p, seed=self.seed, device=self.device)
                probes.append(Probe(p, data, mla_decode_reference(
                    *data, kv_format=shape.kv_format.value)))
            self._probes = tuple(probes)
        return self._probes

    @property
    def shape_key(self) -> str | None:
        """Key of the shape whose input and reference are held now."""
        return self._shape_key

    def free_memory(self) -> None:
        """Hand cached blocks back to the device (a new shape, a failed candidate)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def healthy(self) -> bool:
        """Whether the device still works: after an illegal access the CUDA context is
        broken for good and every later candidate would fail, so the worker retires."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
            return torch.ones(1, device=self.device).add_(1).item() == 2.0
        except Exception:  # noqa: BLE001 - any error here means the context is gone
            return False


class Job(Protocol):
    """A unit of work for a worker. `run` executes in the worker; `lost` is the result the
    driver records when the worker died (`failed`) or overran its limit (`timeout`)."""

    def run(self, ctx: WorkerContext) -> Any: ...

    def lost(self, status: str, cause: str) -> Any: ...


@dataclass(frozen=True)
class TrialJob:
    """Build, verify and time one candidate; plain data so it crosses the process boundary."""

    shape: dict[str, Any]
    backend: str
    config: dict[str, Any]

    def run(self, ctx: WorkerContext) -> TrialOutcome:
        shape = Shape.from_json(self.shape)
        start = time.perf_counter()
        try:
            data, ref, tol = ctx.inputs(shape)
            backend = get_backend(self.backend)
        except Exception as exc:  # noqa: BLE001 - recorded as the candidate's failure
            return TrialOutcome("failed", error=f"could not prepare the candidate: "
                                                f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
        inputs_s = time.perf_counter() - start
        outcome = evaluate(backend, shape, self.config, ctx.device, data, ref, tol, ctx.timer,
                           ctx.probes(shape))
        if outcome.status == "failed":
            ctx.free_memory()
        return replace(outcome, phases={"inputs": inputs_s, **(outcome.phases or {})})

    def lost(self, status: str, cause: str) -> TrialOutcome:
        return TrialOutcome(status, error=cause)


@dataclass(frozen=True)
class RunoffJob:
    """Time a shape's finalists again side by side (mla_tune.tuning.runoff): each is built and
    verified, then all correct ones are timed in turn (`evaluate_side_by_side`). With
    `formats` (one KV format per candidate), candidate i is built for the shape in format
    i and checked against that format's reference: the winners of a call's formats timed
    on one input, as the dispatcher's format choice compares them."""

    shape: dict[str, Any]
    candidates: tuple[tuple[str, dict[str, Any]], ...]  # (backend, config) each
    formats: tuple[str, ...] = ()

    def run(self, ctx: WorkerContext) -> list[TrialOutcome]:
        shape = Shape.from_json(self.shape)
        try:
            data, ref, tol = ctx.inputs(shape)
            backends = [(get_backend(name), config) for name, config in self.candidates]
            checks = {shape.kv_format.value: (ref, tol)}
            for f in self.formats:
                if f not in checks:
                    checks[f] = (mla_decode_reference(*data, kv_format=f),
                                 tolerance_for(KVFormat.parse(f)))
        except Exception as exc:  # noqa: BLE001 - the sweep keeps the first times
            return self.lost("failed", f"could not prepare the finalists: "
                                       f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
        formats = self.formats or (shape.kv_format.value,) * len(backends)
        outcomes = evaluate_together(
            [Contender(b, c, shape.with_format(f), *checks[f])
             for (b, c), f in zip(backends, formats)], ctx.device, data, ctx.timer)
        if any(o.status == "failed" for o in outcomes):
            ctx.free_memory()
        return outcomes

    def lost(self, status: str, cause: str) -> list[TrialOutcome]:
        return [TrialOutcome(status, error=cause) for _ in self.candidates]


@dataclass(frozen=True)
class WarmupJob:
    """Get a worker ready for its first shape while the sweep's kernels are still being
    compiled: import each backend's kernels (through `available`) and make the shape's
    input and reference, so the first candidate pays for neither."""

    shape: dict[str, Any]
    backends: tuple[str, ...]

    def run(self, ctx: WorkerContext) -> None:
        for name in self.backends:
            try:
                get_backend(name).available(ctx.device)
            except Exception:  # noqa: BLE001 - the backend's candidates record the error
                pass
        try:
            ctx.inputs(Shape.from_json(self.shape))
        except Exception:  # noqa: BLE001 - the shape's first candidate records the error
            ctx.free_memory()

    def lost(self, status: str, cause: str) -> None:
        return None


@dataclass(frozen=True)
class BandwidthJob:
    """Measure the device's streaming-read bandwidth (GB/s), the roofline of reports."""

    def run(self, ctx: WorkerContext) -> float | None:
        from mla_tune.machine.bandwidth import measure_read_bandwidth

        return measure_read_bandwidth(ctx.device)

    def lost(self, status: str, cause: str) -> float | None:
        return None


@dataclass(frozen=True)
class Done:
    """A finished job: the slot that ran it and the job's result."""

    slot: int
    job: Job
    result: Any


def _die_with_parent(parent_pid: int) -> None:
    """Make the kernel kill this worker when the driver dies (even by SIGKILL), so an
    orphaned worker never keeps running a hung kernel on a GPU."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the driver died before prctl took effect
        os._exit(1)


def _worker_main(conn: Connection, device: str, backends: Mapping[str, str],
                 policy: TimingPolicy, seed: int, threads: int, parent_pid: int,
                 log_path: str) -> None:
    """Entry point of a worker process: set up, say `ready`, then run jobs until told to
    stop or the driver goes away."""
    _die_with_parent(parent_pid)
    # Ctrl-C and SIGTERM reach the whole process group; the driver decides when workers
    # stop, so a shutdown never looks like a crashing candidate.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    faulthandler.enable()
    try:
        for name, target in backends.items():
            register(name, target)
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(threads)
        ctx = WorkerContext(device, policy, seed)
        conn.send(("ready", current_device(device).to_json()))
    except BaseException:  # noqa: BLE001 - reported to the driver, which gives up the slot
        conn.send(("error", traceback.format_exc()[-LOG_TAIL_CHARS:]))
        return
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        result = job.run(ctx)
        healthy = ctx.healthy()
        conn.send(("done", result, healthy))
        if not healthy:
            return


def _exit_cause(exitcode: int | None, device: str) -> str:
    """Human cause of a worker's death from its exit code."""
    if exitcode is None:
        return f"worker on {device} vanished"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (out of memory?)" if -exitcode == signal.SIGKILL else ""
        return f"worker on {device} killed by {name}{hint}"
    return f"worker on {device} exited with code {exitcode}"


@dataclass
class _Slot:
    index: int
    device: str
    process: BaseProcess | None = None
    conn: Connection | None = None
    log: Path | None = None
    ready: bool = False
    job: Job | None = None
    deadline: float = 0.0
    limit_s: float = 0.0
    start_failures: int = 0
    broken: str | None = None
    incarnation: int = 0
    fingerprint: DeviceFingerprint | None = None
    spawned_at: float = 0.0


class WorkerPool:
    """One worker process per device slot; a worker that dies or overruns is replaced.

    Single-threaded by design: the sweep calls `submit` and `wait` from its loop.
    """

    def __init__(self, devices: Sequence[str], backends: Mapping[str, str],
                 policy: TimingPolicy, seed: int) -> None:
        if not devices:
            raise ValueError("a worker pool needs at least one device")
        self._ctx = multiprocessing.get_context("spawn")
        self._backends = dict(backends)
        self._policy = policy
        self._seed = seed
        # CPU workers share the cores, leaving one to the driver and the OS: oversubscribed
        # OpenMP threads make CPU timings erratic (seen: 0.25 ms -> 150 ms).
        n_cpu = sum(1 for d in devices if torch.device(d).type == "cpu")
        self._threads = max(1, ((os.cpu_count() or 1) - 1) // max(1, n_cpu))
        self._logdir = Path(tempfile.mkdtemp(prefix="mla-tune-workers-"))
        self._slots = [_Slot(i, d) for i, d in enumerate(devices)]
        self.host = socket.gethostname()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def launch(self) -> None:
        """Start every worker without waiting for it: a worker imports torch and sets up its
        device (seconds) while the caller does other start-up work."""
        for slot in self._slots:
            if slot.process is None and slot.broken is None:
                self._spawn(slot)

    def start(self) -> list[tuple[str, DeviceFingerprint]]:
        """Start every worker (unless `launch` did) and wait until each is ready (or given
        up); returns the device and its fingerprint of each started worker. Raises
        WorkerPoolError when none could start."""
        self.launch()
        while any(not s.ready and s.broken is None for s in self._slots):
            self.wait(1.0)
        started = [(s.device, s.fingerprint) for s in self._slots if s.fingerprint is not None]
        if not started:
            causes = "; ".join(f"{s.device}: {s.broken}" for s in self._slots)
            raise WorkerPoolError(f"no worker could start: {causes}")
        return started

    def label(self, slot: int) -> str:
        """Who measured a trial: host and device, so each GPU's timings stay traceable."""
        return f"{self.host}:{self._slots[slot].device}"

    def idle(self) -> list[int]:
        """Slots ready for a job."""
        return [s.index for s in self._slots if s.ready and s.job is None]

    @property
    def size(self) -> int:
        """Worker slots (processes) of this pool."""
        return len(self._slots)

    @property
    def busy(self) -> int:
        return sum(1 for s in self._slots if s.job is not None)

    @property
    def alive(self) -> int:
        return sum(1 for s in self._slots if s.broken is None)

    def submit(self, slot: int, job: Job, limit_s: float) -> None:
        """Send `job` to an idle slot; it must finish within `limit_s` seconds."""
        s = self._slots[slot]
        if not s.ready or s.job is not None or s.conn is None:
            raise RuntimeError(f"worker slot {slot} is not idle")
        s.job, s.limit_s, s.deadline = job, limit_s, time.monotonic() + limit_s
        try:
            s.conn.send(job)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            pass  # the death is picked up by `wait` through the process sentinel

    def wait(self, timeout_s: float) -> list[Done]:
        """Wait up to `timeout_s` for results; also handles deaths, overruns and restarts.
        Returns the jobs finished (or lost) meanwhile."""
        now = time.monotonic()
        deadlines = [s.deadline for s in self._slots
                     if s.process is not None and (s.job is not None or not s.ready)]
        timeout = max(0.0, min([timeout_s, *(d - now for d in deadlines)]))
        conns = {s.conn: s for s in self._slots if s.conn is not None}
        sentinels = {s.process.sentinel: s for s in self._slots if s.process is not None}
        if not conns and not sentinels:
            time.sleep(timeout)
            return []
        ready = wait([*conns, *sentinels], timeout)
        done: list[Done] = []
        for obj in ready:  # messages first: a worker may send its result, then exit
            if obj in conns:
                self._receive(conns[obj], done)
        for obj in ready:
            slot = sentinels.get(obj)
            if slot is not None and slot.process is not None and not slot.process.is_alive():
                self._lost(slot, "failed", _exit_cause(slot.process.exitcode, slot.device), done)
        now = time.monotonic()
        for s in self._slots:
            if s.process is None or now < s.deadline:
                continue
            if s.job is not None:
                self._lost(s, "timeout", f"exceeded the {s.limit_s:g} s candidate limit; "
                                         f"its worker on {s.device} was killed", done)
            elif not s.ready:
                self._lost(s, "failed", f"worker on {s.device} did not start within "
                                        f"{START_TIMEOUT_S:.0f} s", done)
        return done

    def close(self) -> None:
        """Stop every worker now (SIGKILL: a worker may be stuck in a kernel)."""
        for s in self._slots:
            self._stop(s)
        shutil.rmtree(self._logdir, ignore_errors=True)

    def _spawn(self, slot: _Slot) -> None:
        slot.incarnation += 1
        slot.log = self._logdir / f"slot{slot.index}-{slot.incarnation}.log"
        parent, child = self._ctx.Pipe()
        # Not daemonic, so candidates may start processes of their own; `close` (always
        # reached through the context manager) and PR_SET_PDEATHSIG end every worker.
        process = self._ctx.Process(
            target=_worker_main, name=f"mla-tune-worker-{slot.device}",
            args=(child, slot.device, self._backends, self._policy, self._seed,
                  self._threads, os.getpid(), str(slot.log)))
        try:
            process.start()
        finally:
            child.close()
        slot.process, slot.conn, slot.ready, slot.job = process, parent, False, None
        slot.spawned_at = time.monotonic()
        slot.deadline = slot.spawned_at + START_TIMEOUT_S

    def _receive(self, slot: _Slot, done: list[Done]) -> None:
        assert slot.conn is not None
        try:
            message = slot.conn.recv()
        except (EOFError, OSError):
            return  # died; the sentinel reports it
        kind, payload = message[0], message[1]
        if kind == "ready":
            log.debug("worker %d on %s ready after %.1f s", slot.index, slot.device,
                      time.monotonic() - slot.spawned_at)
            slot.ready, slot.start_failures = True, 0
            slot.fingerprint = DeviceFingerprint.from_json(payload)
        elif kind == "error":
            self._stop(slot)
            self._start_failed(slot, payload.strip().splitlines()[-1] if payload else "error")
        elif kind == "done" and slot.job is not None:
            done.append(Done(slot.index, slot.job, payload))
            slot.job = None
            if not message[2]:  # the device is unusable after this job: replace the worker
                self._stop(slot)
                self._spawn(slot)

    def _lost(self, slot: _Slot, status: str, cause: str, done: list[Done]) -> None:
        """The worker of `slot` died or overran: record its job, then replace it."""
        was_ready, job = slot.ready, slot.job
        self._stop(slot)
        tail = self._log_tail(slot)
        if job is not None:
            done.append(Done(slot.index, job, job.lost(
                status, cause + (f"; its last output:\n{tail}" if tail else ""))))
        if was_ready:
            self._spawn(slot)
        else:
            self._start_failed(slot, f"{cause}" + (f": {tail}" if tail else ""))

    def _start_failed(self, slot: _Slot, cause: str) -> None:
        slot.start_failures += 1
        if slot.start_failures >= MAX_START_FAILURES:
            slot.broken = cause
        else:
            self._spawn(slot)

    def _stop(self, slot: _Slot) -> None:
        if slot.process is not None:
            if slot.process.is_alive():
                slot.process.kill()
            slot.process.join(5)
            if slot.process.exitcode is not None:  # else stuck in the GPU driver: leave it
                slot.process.close()
        if slot.conn is not None:
            slot.conn.close()
        slot.process, slot.conn, slot.ready, slot.job = None, None, False, None

    def _log_tail(self, slot: _Slot) -> str:
        """The end of the worker's own output: faulthandler's traceback, CUDA's message."""
        try:
            text = slot.log.read_text(errors="replace") if slot.log else ""
        except OSError:
            return ""
        # faulthandler ends with a long list of loaded extension modules; it says nothing.
        lines = [ln for ln in text.splitlines() if not ln.startswith("Extension modules:")]
        return "\n".join(lines)[-LOG_TAIL_CHARS:].strip()


__all__ = ["BandwidthJob", "Done", "Job", "TrialJob", "WarmupJob", "WorkerContext",
           "WorkerPool", "WorkerPoolError"]
