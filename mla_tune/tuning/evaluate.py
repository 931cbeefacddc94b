"""Evaluate candidates: build -> run once -> verify against the reference -> time, one at a
time (a sweep's trials) or several side by side (its finalists' re-timing).

This is the unit of work of a sweep. It never raises: every failure becomes a recorded
outcome, so one broken variant cannot stop the sweep.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mla_tune.backends.base import Backend, KernelFn
from mla_tune.problem.shapes import Shape, TaskInput
from mla_tune.problem.verify import Tolerance, check
from mla_tune.tuning.timing import Timer, TimingStats

MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class TrialOutcome:
    """What happened to one candidate; maps one-to-one onto a stored trial."""

    status: str  # ok | wrong | failed | timeout
    stats: TimingStats | None = None
    max_abs_err: float | None = None
    mismatch_frac: float | None = None
    error: str | None = None
    # Seconds spent per phase (inputs, precheck, build, verify, time): not stored, logged
    # at debug level so a slow sweep shows where its time goes.
    phases: dict[str, float] | None = None


def _error_text(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[:MAX_ERROR_CHARS]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Probe:
    """A probe batch a variant must also get right (mla_tune.problem.probes), with its task
    input and float32 reference."""

    shape: Shape
    data: TaskInput
    ref: torch.Tensor


def _probe_verdict(backend: Backend, config: Mapping[str, Any], device: torch.device,
                   probe: Probe, tol: Tolerance) -> TrialOutcome | None:
    """Why the variant is wrong on `probe` ('wrong' outcome), or None: right there, or not
    a variant the probe's shape can run (the runtime would not route it there either)."""
    if (backend.supports(probe.shape) or not backend.feasible(probe.shape, config)
            or backend.precheck(probe.shape, config, device)):
        return None
    where = (f"the ragged probe batch (q_len {probe.shape.q_len}, kv lengths "
             f"{', '.join(map(str, probe.shape.kv_lens))})")
    try:
        out = backend.build(probe.shape, config, device)(probe.data)
        _sync(device)
    except Exception as exc:
        raise RuntimeError(f"on {where}: {_error_text(exc)}") from exc
    result = check(out, probe.ref, tol)
    if result.ok:
        return None
    return TrialOutcome("wrong", max_abs_err=result.max_abs_err,
                        mismatch_frac=result.mismatch_frac,
                        error=f"wrong on {where}: {result.reason}")


def _build_verified(backend: Backend, shape: Shape, config: Mapping[str, Any],
                    device: torch.device, data: TaskInput, ref: torch.Tensor, tol: Tolerance,
                    lap: Callable[[str], None], probes: Sequence[Probe] = ()
                    ) -> tuple[KernelFn | None, TrialOutcome]:
    """(the built variant, its 'ok' outcome without timing) if it is correct on the shape
    and on every probe batch it can run, else (None, why not); raises on errors."""
    reason = backend.precheck(shape, config, device)
    lap("precheck")
    if reason:
        return None, TrialOutcome("failed", error=f"skipped before timing: {reason}")
    fn = backend.build(shape, config, device)
    lap("build")
    out = fn(data)
    _sync(device)
    result = check(out, ref, tol)
    lap("verify")
    if not result.ok:
        return None, TrialOutcome("wrong", max_abs_err=result.max_abs_err,
                                  mismatch_frac=result.mismatch_frac, error=result.reason)
    for probe in probes:
        wrong = _probe_verdict(backend, config, device, probe, tol)
        if wrong is not None:
            lap("probes")
            return None, wrong
    if probes:
        lap("probes")
    return fn, TrialOutcome("ok", None, result.max_abs_err, result.mismatch_frac)


def _laps() -> tuple[dict[str, float], Callable[[str], None]]:
    phases: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = now - clock
        clock = now

    return phases, lap


def evaluate(backend: Backend, shape: Shape, config: Mapping[str, Any], device: torch.device,
             data: TaskInput, ref: torch.Tensor, tol: Tolerance, timer: Timer,
             probes: Sequence[Probe] = ()) -> TrialOutcome:
    """Build, verify and time one variant; a variant is timed only if it is correct, on
    the shape and on the `probes` it can run."""
    device = torch.device(device)
    phases, lap = _laps()
    try:
        fn, outcome = _build_verified(backend, shape, config, device, data, ref, tol, lap,
                                      probes)
        if fn is None:
            return replace(outcome, phases=phases)
        stats = timer.measure(lambda: fn(data))
        lap("time")
        return replace(outcome, stats=stats, phases=phases)
    except Exception as exc:  # noqa: BLE001 - any variant failure is data, not a crash
        return TrialOutcome("failed", error=_error_text(exc), phases=phases)


def evaluate_side_by_side(candidates: Sequence[tuple[Backend, Mapping[str, Any]]],
                          shape: Shape, device: torch.device, data: TaskInput,
                          ref: torch.Tensor, tol: Tolerance, timer: Timer) -> list[TrialOutcome]:
    """Build and verify several variants of one shape, then time the correct ones in turn
    (`Timer.measure_interleaved`), so they share the device's slow and fast moments. One
    outcome per candidate, in order; never raises."""
    return evaluate_together([Contender(b, c, shape, ref, tol) for b, c in candidates],
                             device, data, timer)


@dataclass(frozen=True)
class Contender:
    """One variant of a side-by-side run, with the shape it is built for and what its output
    is checked against (variants of several KV formats of one call share one task input)."""

    backend: Backend
    config: Mapping[str, Any]
    shape: Shape
    ref: torch.Tensor
    tol: Tolerance


def evaluate_together(contenders: Sequence[Contender], device: torch.device, data: TaskInput,
                      timer: Timer) -> list[TrialOutcome]:
    """`evaluate_side_by_side` for variants that may be built for different shapes of one
    task input (each KV format of a call): one outcome per contender; never raises."""
    device = torch.device(device)
    outcomes: list[TrialOutcome] = []
    fns: list[tuple[int, KernelFn]] = []
    for i, c in enumerate(contenders):
        phases, lap = _laps()
        try:
            fn, outcome = _build_verified(c.backend, c.shape, c.config, device, data, c.ref,
                                          c.tol, lap)
        except Exception as exc:  # noqa: BLE001 - any variant failure is data, not a crash
            fn, outcome = None, TrialOutcome("failed", error=_error_text(exc))
        outcomes.append(replace(outcome, phases=phases))
        if fn is not None:
            fns.append((i, fn))
    if not fns:
        return outcomes
    try:
        stats = timer.measure_interleaved([functools.partial(f, data) for _, f in fns])
    except Exception as exc:  # noqa: BLE001 - one failing call ends the round for all
        err = _error_text(exc)
        return [replace(o, status="failed", error=err) if o.status == "ok" else o
                for o in outcomes]
    for (i, _), st in zip(fns, stats):
        outcomes[i] = replace(outcomes[i], stats=st)
    return outcomes
