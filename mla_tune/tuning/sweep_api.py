"""What a sweep takes and gives back: its options, the result per shape, the progress hooks
a UI implements, and the errors it raises (`mla_tune.tuning.sweep` runs it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mla_tune.problem.shapes import Shape
from mla_tune.results.winner import Winner
from mla_tune.tuning.compile_ahead import CompileSummary
from mla_tune.tuning.evaluate import TrialOutcome
from mla_tune.tuning.runoff import DEFAULT_FINALISTS
from mla_tune.tuning.search import Strategy
from mla_tune.tuning.timing import TimingPolicy


@dataclass(frozen=True)
class SweepOptions:
    """How to sweep. `devices` has one entry per worker process (`cuda:0`, `cuda:1`, or
    `cpu`); their device fingerprints must match, since their timings are pooled."""

    devices: tuple[str, ...] = ("cpu",)
    strategy: Strategy = Strategy.GRID
    budget: int | None = None
    seed: int = 0
    policy: TimingPolicy = field(default_factory=TimingPolicy)
    baselines: bool = True
    candidate_timeout_s: float = 120.0
    # Per backend, knobs narrowed to some of their declared values (`--pin`).
    pins: Mapping[str, Mapping[str, list[Any]]] = field(default_factory=dict)
    heartbeat_s: float = 5.0
    stale_after_s: float = 60.0
    # Compile each distinct kernel once in CPU processes while the GPU workers start.
    compile_ahead: bool = True
    # Trial outcomes to measure again (`--retry`): stored trials with these statuses are
    # deleted for the keys swept, so their configs are candidates again.
    retry: tuple[str, ...] = ()
    # Finalists timed again side by side before a shape's winner is picked
    # (`--runoff`, mla_tune.tuning.runoff); below 2, winners come from the first times.
    runoff: int = DEFAULT_FINALISTS


class SweepError(RuntimeError):
    """The sweep cannot run as asked; the message says why."""


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
    winner: Winner | None
    backends: list[BackendSummary]
    # Finalists whose times come from one side-by-side run (0: the first times stand).
    side_by_side: int = 0


class SweepInterrupted(Exception):
    """Raised after a clean stop (Ctrl-C, SIGTERM): every finished trial is stored, the
    candidates that were running are back in the queue, and re-running the same command
    finishes the rest."""

    def __init__(self, results: list[ShapeResult], new_trials: int, requeued: int) -> None:
        super().__init__(f"sweep interrupted after {new_trials} new trials")
        self.results = results
        self.new_trials = new_trials
        self.requeued = requeued


class SweepObserver(Protocol):
    """Progress hooks for a UI; the sweep itself prints nothing."""

    def shape_started(self, shape: Shape, backends: Sequence[str]) -> None: ...

    def backend_started(self, shape: Shape, backend: str, todo: int) -> None: ...

    def trial_done(self, shape: Shape, backend: str, config: dict[str, Any],
                   outcome: TrialOutcome, best_us: float | None) -> None: ...

    def shape_done(self, result: ShapeResult) -> None: ...

    def compile_done(self, summary: CompileSummary) -> None: ...
