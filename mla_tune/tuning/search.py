"""Search driver: which configs of a backend to measure for a shape, and in what order.

Our trial table is the source of truth (a config measured once for a key is never measured
again); the Optuna study (`mla_tune.tuning.optuna_study`) mirrors every measurement so samplers
learn from them and optuna-dashboard can show them. `grid` walks the feasible grid in
order; `tpe` and `random` ask Optuna's samplers, within a budget of distinct measured
configs per (key, backend).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from mla_tune.tuning import optuna_study
from mla_tune.tuning.space import ParamSpace, config_key

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Asks in a row without a new feasible config before the sampler is considered converged.
_MAX_STALE_ASKS = 50


class Strategy(str, enum.Enum):
    GRID = "grid"
    TPE = "tpe"
    RANDOM = "random"


def make_sampler(strategy: Strategy, seed: int) -> optuna.samplers.BaseSampler:
    """The Optuna sampler for a strategy (grid walks the grid itself and only records)."""
    if strategy is Strategy.TPE:
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    return optuna.samplers.RandomSampler(seed=seed)


Objective = Callable[[dict[str, Any]], float | None]


class SearchDriver:
    """Proposes configs and mirrors each result into an Optuna study.

    Several configs may be out for measurement at once (`ask` several times, then `tell`
    each result), so a pool of workers can be kept busy.
    """

    def __init__(self, study: optuna.Study, space: ParamSpace,
                 candidates: list[dict[str, Any]], strategy: Strategy,
                 budget: int | None, measured: Mapping[str, float | None]) -> None:
        self.study = study
        self.strategy = strategy
        self.candidates = candidates
        self.measured = dict(measured)
        self.distributions = {name: CategoricalDistribution(list(choices))
                              for name, choices in space.params}
        # Each candidate's key, computed once (`_todo` runs several times per trial).
        self._keys = [config_key(c) for c in candidates]
        self._feasible = set(self._keys)
        self.budget = budget
        # Configs handed out and not told yet, with the Optuna trial they were asked as
        # (None for one claimed from the queue rather than asked here).
        self._pending: dict[str, optuna.Trial | None] = {}
        # Configs another sweep measures (or has measured): never proposed again here, and
        # neither a result nor a budget slot of this driver.
        self._elsewhere: set[str] = set()
        self._stale = 0
        # Configs of this key that every sweep on the DB has measured or is measuring
        # (`note_spent`): the budget counts them, not only this driver's.
        self._spent = 0
        self._heartbeat = optuna_study.heartbeat_enabled(study)
        if self._heartbeat:  # fail trials a killed process left RUNNING
            optuna_study.fail_stale_trials(study)

    def remaining(self) -> int:
        """Configs still to measure under the budget (not counting those out now)."""
        return self._within_budget(len(self._todo()))

    def has_room(self) -> bool:
        """Whether the budget allows another config to go out, wherever it comes from
        (asked here or claimed from the queue)."""
        return self.budget is None or self._room() > 0

    def grid_todo(self) -> list[dict[str, Any]]:
        """The grid configs still to measure under the budget, in grid order."""
        todo = self._todo()
        return todo[:self._within_budget(len(todo))]

    def taken(self, config: dict[str, Any]) -> None:
        """`config` was claimed from the queue (left there by a grid run or a stopped
        sweep) rather than asked here: it is out for measurement and counts against the
        budget like an asked one until it is told."""
        key = config_key(config)
        self._elsewhere.discard(key)
        self._pending.setdefault(key, None)

    def note_spent(self, spent: int) -> None:
        """`spent` configs of this key are measured or out for measurement, by any sweep
        (`BaseTuningStore.spent`): the budget is shared by every sweep of the key."""
        self._spent = spent

    def withdraw(self, config: dict[str, Any]) -> None:
        """`config`, asked here, will not be measured (the budget was spent meanwhile by
        other sweeps): its Optuna trial is closed as FAIL, marked, and the config is not a
        result."""
        trial = self._pending.pop(config_key(config), None)
        if trial is not None:
            trial.set_user_attr("withdrawn", True)
            self.study.tell(trial, state=TrialState.FAIL)

    def measured_elsewhere(self, config: dict[str, Any]) -> None:
        """`config`, asked here, is measured or being measured by another sweep. It is not
        a failure: it stays out of `measured` and of this driver's budget (the sweep that
        holds it measures it), and it is not proposed again. Its Optuna trial is closed
        as FAIL, the one state the samplers ignore (TPE ranks a PRUNED trial without
        values among the worst), and marked, so the study learns the config's value only
        from the holder's trial."""
        key = config_key(config)
        trial = self._pending.pop(key, None)
        self._elsewhere.add(key)
        if trial is not None:
            trial.set_user_attr("measured_elsewhere", True)
            self.study.tell(trial, state=TrialState.FAIL)

    def ask(self) -> dict[str, Any] | None:
        """The next config to measure, or None when the budget or the candidates are used
        up. `grid` walks the grid; `tpe`/`random` ask the sampler and, once it only
        repeats itself, fill the budget from the grid."""
        todo = self._todo()
        if self._within_budget(len(todo)) <= 0:
            return None
        if self.strategy is not Strategy.GRID:
            config = self._ask_sampler()
            if config is not None:
                return config
        # A sampler that found nothing new changed nothing `todo` depends on.
        self._pending[config_key(todo[0])] = None
        return todo[0]

    def tell(self, config: dict[str, Any], value: float | None) -> None:
        """The result of `config` (its time, or None when the variant is not ok), whether
        asked here or measured by another process."""
        key = config_key(config)
        trial = self._pending.pop(key, None)
        self._elsewhere.discard(key)
        self.measured[key] = value
        self._tell(config, trial, value)

    def keep_alive(self) -> None:
        """Heartbeat the Optuna trials out for measurement, so they are not failed as
        stale while a worker is still on them."""
        if self._heartbeat:
            for trial in self._pending.values():
                if trial is not None:
                    optuna_study.record_heartbeat(self.study, trial)

    def abandon(self) -> None:
        """Close the Optuna trials of configs out for measurement (a stopped sweep); the
        configs are measured by the next run."""
        for trial in self._pending.values():
            if trial is not None:
                self.study.tell(trial, state=TrialState.FAIL)
        self._pending.clear()

    def run(self, objective: Objective) -> int:
        """Measure configs one at a time with `objective` (returns the time, or None when
        the variant is not ok) until done; returns how many were measured."""
        count = 0
        while (config := self.ask()) is not None:
            self.tell(config, objective(config))
            count += 1
        return count

    def _todo(self) -> list[dict[str, Any]]:
        """Candidates nobody has measured or is measuring, as far as this driver knows."""
        return [c for c, k in zip(self.candidates, self._keys) if k not in self.measured
                and k not in self._pending and k not in self._elsewhere]

    def _within_budget(self, todo: int) -> int:
        """How many of `todo` configs the budget still allows."""
        return todo if self.budget is None else min(todo, self._room())

    def _room(self) -> int:
        assert self.budget is not None
        return max(0, self.budget - max(len(self.measured) + len(self._pending), self._spent))

    def reconcile(self, stored: Mapping[str, float | None]) -> int:
        """Tell the study the stored results (config key -> time, None when not ok) it
        lacks; returns how many. Our table is the source of truth, and a sweep killed
        between storing a trial and telling Optuna, or a study made anew for results
        already stored (e.g. after `mla-tune rehash`), leaves the study short. A stored
        time needs a COMPLETE trial; a failed config, any trial of its own."""
        if not stored:
            return 0
        complete: dict[str, bool] = {}
        for t in self.study.get_trials(deepcopy=False,
                                       states=(TrialState.COMPLETE, TrialState.FAIL)):
            if t.user_attrs.get("measured_elsewhere") or t.user_attrs.get("withdrawn"):
                continue
            key = config_key(t.params)
            complete[key] = complete.get(key, False) or t.state == TrialState.COMPLETE
        told = 0
        for key, value in stored.items():
            if key in complete and (value is None or complete[key]):
                continue
            config = json.loads(key)
            if self._fits(config):
                self._tell(config, None, value)
                told += 1
        return told

    def _fits(self, config: Mapping[str, Any]) -> bool:
        """Whether `config` is a point of this space (stored configs of an older space
        cannot be told to the study)."""
        return (isinstance(config, dict) and set(config) == set(self.distributions)
                and all(config[k] in d.choices for k, d in self.distributions.items()))

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

    def _ask_sampler(self) -> dict[str, Any] | None:
        """A new feasible config from the sampler, or None once it has proposed only
        infeasible or known configs _MAX_STALE_ASKS times in a row."""
        while self._stale < _MAX_STALE_ASKS:
            trial = optuna_study.ask(self.study, self.distributions)
            config = dict(trial.params)
            key = config_key(config)
            if key not in self._feasible or key in self._pending or key in self._elsewhere:
                self.study.tell(trial, state=TrialState.FAIL)
            elif key in self.measured:
                self._tell(config, trial, self.measured[key])
            else:
                self._stale = 0
                self._pending[key] = trial
                if self._heartbeat:
                    optuna_study.record_heartbeat(self.study, trial)
                return config
            self._stale += 1
        return None
