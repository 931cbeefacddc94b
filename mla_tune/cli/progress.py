"""Terminal progress for a sweep: a live bar per shape and a best-so-far line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mla_tune.problem.shapes import Shape
from mla_tune.tuning.evaluate import TrialOutcome


class SweepProgress:
    """A `SweepObserver` that renders with rich (plain lines when not a terminal)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[best]}"), console=console)
        # Workers move on to the next shape while the last candidates of one still run,
        # so bars and best times are kept per shape (and bar per backend).
        self._tasks: dict[tuple[str, str], Any] = {}
        self._best: dict[str, float] = {}

    def __enter__(self) -> "SweepProgress":
        self.progress.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.progress.stop()

    def shape_started(self, shape: Shape, backends: Sequence[str]) -> None:
        self._best.pop(shape.key, None)

    def backend_started(self, shape: Shape, backend: str, todo: int) -> None:
        self._tasks[shape.key, backend] = self.progress.add_task(
            f"{shape.label()} · {backend}", total=todo, best=self._best_text(shape))

    def trial_done(self, shape: Shape, backend: str, config: dict[str, Any],
                   outcome: TrialOutcome, best_us: float | None) -> None:
        best = self._best.get(shape.key)
        if outcome.stats and (best is None or outcome.stats.median_us < best):
            self._best[shape.key] = outcome.stats.median_us
            self.console.print(f"  best so far {shape.label()}: {backend} "
                               f"{json.dumps(config, sort_keys=True)} "
                               f"{outcome.stats.median_us:.1f} µs", highlight=False,
                               markup=False, emoji=False)
        elif outcome.status != "ok":
            first = outcome.error.splitlines()[0][:120] if outcome.error else ""
            self.console.print(f"  {outcome.status}: {backend} "
                               f"{json.dumps(config, sort_keys=True)} {first}",
                               highlight=False, style="dim", markup=False, emoji=False)
        task = self._tasks.get((shape.key, backend))
        if task is not None:
            self.progress.update(task, advance=1, best=self._best_text(shape))

    def shape_done(self, result: Any) -> None:
        for key in [k for k in self._tasks if k[0] == result.shape.key]:
            self.progress.remove_task(self._tasks.pop(key))

    def compile_done(self, summary: Any) -> None:
        failed = f", {len(summary.failed)} failed" if summary.failed else ""
        left = f", {summary.unfinished} left to the GPU workers" if summary.unfinished else ""
        self.console.print(f"compiled {summary.compiled} of {summary.kernels} kernel(s) ahead "
                           f"on {summary.processes} CPU process(es) in {summary.seconds:.1f} s"
                           f"{failed}{left}", highlight=False, style="dim")
        for line in summary.failed[:3]:
            self.console.print(f"  compile failed: {line.splitlines()[0][:160]}",
                               highlight=False, style="dim", markup=False, emoji=False)

    def _best_text(self, shape: Shape) -> str:
        best = self._best.get(shape.key)
        return f"best {best:.1f} µs" if best is not None else ""
