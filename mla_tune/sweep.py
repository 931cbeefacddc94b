"""The sweep: for each shape, every available backend's candidates are built, verified
against the float32 reference, timed, and stored; then the shape's winner is updated.

Library baselines (FlashInfer, aiter) and the torch family are always timed when
available, so every winner can be compared with what users already have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import optuna
import torch

from mla_tune.backends import Backend, backend_names, get_backend
from mla_tune.db import TuningStore, WinnerRow
from mla_tune.evaluate import TrialOutcome, evaluate
from mla_tune.fingerprint import current_device, current_software
from mla_tune.problem import Shape, generate_input
from mla_tune.reference import mla_decode_reference
from mla_tune.search import SearchDriver, Strategy, make_sampler, study_name
from mla_tune.timing import TimingPolicy, make_timer
from mla_tune.verify import tolerance_for

BASELINE_BACKENDS = ("flashinfer", "aiter", "torch")


@dataclass(frozen=True)
class SweepOptions:
    device: str = "cpu"
    strategy: Strategy = Strategy.GRID
    budget: int | None = None
    seed: int = 0
    policy: TimingPolicy = field(default_factory=TimingPolicy)
    baselines: bool = True


@dataclass
class BackendSummary:
    name: str
    skipped: str | None = None
    new_trials: int = 0
    reused_trials: int = 0
    best_us: float | None = None


@dataclass
class ShapeResult:
    shape: Shape
    winner: WinnerRow | None
    backends: list[BackendSummary]


class SweepObserver(Protocol):
    """Progress hooks for a UI; the sweep itself prints nothing."""

    def shape_started(self, shape: Shape, backends: Sequence[str]) -> None: ...

    def backend_started(self, shape: Shape, backend: str, todo: int) -> None: ...

    def trial_done(self, shape: Shape, backend: str, config: dict[str, Any],
                   outcome: TrialOutcome, best_us: float | None) -> None: ...

    def shape_done(self, result: ShapeResult) -> None: ...


def resolve_backends(names: Sequence[str] | None, baselines: bool) -> list[Backend]:
    """The backends to sweep: the named ones (all when none named) plus the baselines."""
    chosen = list(names) if names else backend_names()
    if baselines:
        chosen += [b for b in BASELINE_BACKENDS if b in backend_names() and b not in chosen]
    return [get_backend(n) for n in dict.fromkeys(chosen)]


def run_sweep(shapes: Sequence[Shape], backends: Sequence[Backend], store: TuningStore,
              options: SweepOptions, observer: SweepObserver | None = None) -> list[ShapeResult]:
    """Tune every shape; trials already stored for the same key are reused, never re-run."""
    device = torch.device(options.device)
    usable: list[Backend] = []
    skipped: dict[str, str] = {}
    for b in backends:
        avail = b.available(device)
        if avail:
            usable.append(b)
        else:
            skipped[b.name] = avail.reason
    versions: dict[str, str] = {}
    for b in usable:
        versions.update(b.versions())
    dev_fp, sw_fp = current_device(device), current_software(versions)
    device_id, software_id = store.device_id(dev_fp), store.software_id(sw_fp)
    sources = {n: get_backend(n).source_hash() for n in backend_names()}
    timer = make_timer(device, options.policy)
    storage = store.optuna_storage()

    results = []
    for shape in shapes:
        if observer:
            observer.shape_started(shape, [b.name for b in backends])
        data = generate_input(shape, seed=options.seed, device=device)
        ref = mla_decode_reference(*data, kv_format=shape.kv_format.value)
        tol = tolerance_for(shape.kv_format)
        summaries = [BackendSummary(n, skipped=r) for n, r in skipped.items()]
        for backend in usable:
            summary = BackendSummary(backend.name)
            summaries.append(summary)
            reason = backend.supports(shape)
            if reason:
                summary.skipped = reason
                continue
            source = sources[backend.name]
            prior = store.measured(device_id, software_id, shape.key, backend.name, source)
            measured = {k: (t.median_us if t.status == "ok" else None) for k, t in prior.items()}
            summary.reused_trials = len(measured)
            oks = [v for v in measured.values() if v is not None]
            summary.best_us = min(oks) if oks else None
            study = optuna.create_study(
                storage=storage, load_if_exists=True, direction="minimize",
                study_name=study_name(dev_fp.hash, sw_fp.hash, shape.key, backend.name, source),
                sampler=make_sampler(options.strategy, options.seed))
            driver = SearchDriver(study, backend.declared_space(device),
                                  backend.candidates(shape, device), options.strategy,
                                  options.budget, measured)
            if observer:
                observer.backend_started(shape, backend.name, driver.remaining())

            def objective(config: dict[str, Any], backend: Backend = backend,
                          summary: BackendSummary = summary) -> float | None:
                outcome = evaluate(backend, shape, config, device, data, ref, tol, timer)
                store.record_trial(
                    device_id=device_id, software_id=software_id, shape_key=shape.key,
                    shape_json=shape.to_json(), kv_format=shape.kv_format.value,
                    backend=backend.name, source_hash=sources[backend.name], config=config,
                    status=outcome.status,
                    stats=outcome.stats.to_dict() if outcome.stats else None,
                    max_abs_err=outcome.max_abs_err, mismatch_frac=outcome.mismatch_frac,
                    error=outcome.error)
                value = outcome.stats.median_us if outcome.stats else None
                if value is not None and (summary.best_us is None or value < summary.best_us):
                    summary.best_us = value
                if observer:
                    observer.trial_done(shape, backend.name, config, outcome, summary.best_us)
                return value

            summary.new_trials = driver.run(objective)
        winner = store.update_winner(device_id, software_id, shape.key, sources)
        result = ShapeResult(shape, winner, summaries)
        results.append(result)
        if observer:
            observer.shape_done(result)
    return results


__all__ = ["BackendSummary", "ShapeResult", "SweepObserver", "SweepOptions",
           "resolve_backends", "run_sweep"]
