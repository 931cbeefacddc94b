"""Search driver: which configs of a backend to measure for a shape, and in what order.

Our trial table is the source of truth (a config measured once for a key is never measured
again); the Optuna study mirrors every measurement so samplers learn from them and
optuna-dashboard can show them. `grid` walks the feasible grid in order; `tpe` and `random`
ask Optuna's samplers, within a budget of distinct measured configs per (key, backend).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from mla_tune.space import ParamSpace, config_key

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Asks in a row without a new feasible config before the sampler is considered converged.
_MAX_STALE_ASKS = 50


class Strategy(str, enum.Enum):
    GRID = "grid"
    TPE = "tpe"
    RANDOM = "random"


def study_name(device_hash: str, software_hash: str, shape_key: str, backend: str,
               source_hash: str) -> str:
    """One study per (tuning key, backend), as the DB key defines it."""
    return f"mla-tune:{device_hash}:{software_hash}:{shape_key}:{backend}:{source_hash}"


def make_sampler(strategy: Strategy, seed: int) -> optuna.samplers.BaseSampler:
    """The Optuna sampler for a strategy (grid walks the grid itself and only records)."""
    if strategy is Strategy.TPE:
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    return optuna.samplers.RandomSampler(seed=seed)


Objective = Callable[[dict[str, Any]], float | None]


class SearchDriver:
    """Proposes configs one at a time and mirrors each result into an Optuna study."""

    def __init__(self, study: optuna.Study, space: ParamSpace,
                 candidates: list[dict[str, Any]], strategy: Strategy,
                 budget: int | None, measured: Mapping[str, float | None]) -> None:
        self.study = study
        self.strategy = strategy
        self.candidates = candidates
        self.measured = dict(measured)
        self.distributions = {name: CategoricalDistribution(list(choices))
                              for name, choices in space.params}
        self._feasible = {config_key(c) for c in candidates}
        self.budget = budget

    def remaining(self) -> int:
        """Configs still to measure under the budget."""
        todo = sum(1 for c in self.candidates if config_key(c) not in self.measured)
        if self.budget is None:
            return todo
        return max(0, min(todo, self.budget - len(self.measured)))

    def run(self, objective: Objective) -> int:
        """Measure configs with `objective` (returns the time, or None when the variant is
        not ok) until done; returns how many new configs were measured."""
        gen = self._grid() if self.strategy is Strategy.GRID else self._sampled()
        count = 0
        for config, trial in gen:
            value = objective(config)
            self.measured[config_key(config)] = value
            self._tell(config, trial, value)
            count += 1
        return count

    def _tell(self, config: dict[str, Any], trial: optuna.Trial | None,
              value: float | None) -> None:
        if trial is not None:
            if value is None:
                self.study.tell(trial, state=TrialState.FAIL)
            else:
                self.study.tell(trial, value)
            return
        self.study.add_trial(optuna.trial.create_trial(
            params=config, distributions=self.distributions, value=value,
            state=TrialState.COMPLETE if value is not None else TrialState.FAIL))

    def _grid(self) -> Iterator[tuple[dict[str, Any], None]]:
        left = self.remaining()
        for config in self.candidates:
            if left <= 0:
                return
            if config_key(config) in self.measured:
                continue
            left -= 1
            yield config, None

    def _sampled(self) -> Iterator[tuple[dict[str, Any], optuna.Trial | None]]:
        """Ask the sampler; once it only repeats itself, fill the budget from the grid."""
        stale = 0
        while self.remaining() > 0 and stale < _MAX_STALE_ASKS:
            trial = self.study.ask(self.distributions)
            config = dict(trial.params)
            key = config_key(config)
            if key not in self._feasible:
                self.study.tell(trial, state=TrialState.FAIL)
                stale += 1
                continue
            if key in self.measured:
                prior = self.measured[key]
                if prior is None:
                    self.study.tell(trial, state=TrialState.FAIL)
                else:
                    self.study.tell(trial, prior)
                stale += 1
                continue
            stale = 0
            yield config, trial
        yield from self._grid()
