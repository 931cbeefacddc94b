"""Evaluate one candidate: build -> run once -> verify against the reference -> time.

This is the unit of work of a sweep. It never raises: every failure becomes a recorded
outcome, so one broken variant cannot stop the sweep.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mla_tune.backends.base import Backend
from mla_tune.problem import Shape, TaskInput
from mla_tune.timing import Timer, TimingStats
from mla_tune.verify import Tolerance, check

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


def evaluate(backend: Backend, shape: Shape, config: Mapping[str, Any], device: torch.device,
             data: TaskInput, ref: torch.Tensor, tol: Tolerance, timer: Timer) -> TrialOutcome:
    """Build, verify and time one variant; a variant is timed only if it is correct."""
    device = torch.device(device)
    phases: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = now - clock
        clock = now

    try:
        reason = backend.precheck(shape, config, device)
        lap("precheck")
        if reason:
            return TrialOutcome("failed", error=f"skipped before timing: {reason}",
                                phases=phases)
        fn = backend.build(shape, config, device)
        lap("build")
        out = fn(data)
        _sync(device)
        result = check(out, ref, tol)
        lap("verify")
        if not result.ok:
            return TrialOutcome("wrong", max_abs_err=result.max_abs_err,
                                mismatch_frac=result.mismatch_frac, error=result.reason,
                                phases=phases)
        stats = timer.measure(lambda: fn(data))
        lap("time")
        return TrialOutcome("ok", stats, result.max_abs_err, result.mismatch_frac,
                            phases=phases)
    except Exception as exc:  # noqa: BLE001 - any variant failure is data, not a crash
        return TrialOutcome("failed", error=_error_text(exc), phases=phases)
