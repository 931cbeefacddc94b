"""Terminal progress for a sweep: a live bar per shape and a best-so-far line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mla_tune.evaluate import TrialOutcome
from mla_tune.problem import Shape


class SweepProgress:
    """A `SweepObserver` that renders with rich (plain lines when not a terminal)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[best]}"), console=console)
        self._task: Any = None
        self._best: float | None = None

    def __enter__(self) -> "SweepProgress":
        self.progress.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.progress.stop()

    def shape_started(self, shape: Shape, backends: Sequence[str]) -> None:
        self._best = None

    def backend_started(self, shape: Shape, backend: str, todo: int) -> None:
        if self._task is not None:
            self.progress.remove_task(self._task)
        self._task = self.progress.add_task(f"{shape.label()} · {backend}", total=todo,
                                            best=self._best_text())

    def trial_done(self, shape: Shape, backend: str, config: dict[str, Any],
                   outcome: TrialOutcome, best_us: float | None) -> None:
        if outcome.stats and (self._best is None or outcome.stats.median_us < self._best):
            self._best = outcome.stats.median_us
            self.console.print(f"  best so far {shape.label()}: {backend} "
                               f"{json.dumps(config, sort_keys=True)} {self._best:.1f} µs",
                               highlight=False)
        elif outcome.status != "ok":
            self.console.print(f"  {outcome.status}: {backend} "
                               f"{json.dumps(config, sort_keys=True)} "
                               f"{(outcome.error or '').splitlines()[0][:120] if outcome.error else ''}",
                               highlight=False, style="dim")
        self.progress.update(self._task, advance=1, best=self._best_text())

    def shape_done(self, result: Any) -> None:
        if self._task is not None:
            self.progress.remove_task(self._task)
            self._task = None

    def _best_text(self) -> str:
        return f"best {self._best:.1f} µs" if self._best is not None else ""
