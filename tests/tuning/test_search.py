import optuna

from mla_tune.tuning.search import SearchDriver, Strategy, make_sampler
from mla_tune.tuning.space import ParamSpace, config_key

SPACE = ParamSpace.from_mapping({"bn": [16, 32, 64], "splits": [1, 2, 4, 8]})


def _driver(strategy, budget=None, measured=None, candidates=None):
    study = optuna.create_study(direction="minimize", sampler=make_sampler(strategy, 0))
    cands = candidates if candidates is not None else list(SPACE.grid())
    return SearchDriver(study, SPACE, cands, strategy, budget, measured or {}), study


def _cost(c):
    return abs(c["bn"] - 32) + abs(c["splits"] - 4) + 1.0


def test_grid_measures_every_candidate_once_and_mirrors_to_optuna():
    d, study = _driver(Strategy.GRID)
    seen = []
    assert d.run(lambda c: seen.append(c) or _cost(c)) == 12
    assert len({config_key(c) for c in seen}) == 12
    assert len(study.trials) == 12 and study.best_value == 1.0
    assert study.best_params == {"bn": 32, "splits": 4}


def test_grid_skips_already_measured_and_respects_budget():
    measured = {config_key(c): 5.0 for c in list(SPACE.grid())[:5]}
    d, _ = _driver(Strategy.GRID, budget=8, measured=measured)
    seen = []
    d.run(lambda c: seen.append(c) or 1.0)
    assert len(seen) == 3
    assert not {config_key(c) for c in seen} & set(measured)
    d2, _ = _driver(Strategy.GRID, budget=5, measured=measured)
    assert d2.run(lambda c: 1.0) == 0


def test_failed_trials_are_recorded_as_fail():
    d, study = _driver(Strategy.GRID)
    d.run(lambda c: None if c["splits"] == 8 else _cost(c))
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.FAIL) == 3


def test_tpe_and_random_stay_feasible_and_within_budget():
    feasible = [c for c in SPACE.grid() if c["bn"] * c["splits"] <= 128]
    for strategy in (Strategy.TPE, Strategy.RANDOM):
        d, _ = _driver(strategy, budget=6, candidates=feasible)
        seen = []
        n = d.run(lambda c: seen.append(c) or _cost(c))
        assert n == len(seen) == 6
        assert all(c["bn"] * c["splits"] <= 128 for c in seen)
        assert len({config_key(c) for c in seen}) == 6


def test_sampled_search_exhausts_small_space():
    cands = [{"bn": 16, "splits": 1}, {"bn": 64, "splits": 8}]
    d, _ = _driver(Strategy.RANDOM, candidates=cands)
    assert d.run(_cost) == 2


def test_several_asks_out_at_once_never_repeat_and_respect_the_budget():
    for strategy in (Strategy.GRID, Strategy.TPE):
        d, _ = _driver(strategy, budget=5)
        out = [d.ask() for _ in range(5)]
        assert None not in out and len({config_key(c) for c in out}) == 5
        assert d.ask() is None and d.remaining() == 0
        for c in out:
            d.tell(c, _cost(c))
        assert d.ask() is None and len(d.measured) == 5


def test_running_trials_of_a_dead_process_are_failed_unless_heartbeated(tmp_path):
    import time

    from mla_tune.db import TuningStore

    def driver():
        storage = store.optuna_storage(heartbeat_s=1, grace_s=1)
        study = optuna.create_study(study_name="s", storage=storage, load_if_exists=True,
                                    sampler=make_sampler(Strategy.TPE, 0))
        return SearchDriver(study, SPACE, list(SPACE.grid()), Strategy.TPE, None, {}), study

    with TuningStore(f"sqlite:///{tmp_path / 't.db'}") as store:
        alive, _ = driver()
        dead, _ = driver()
        kept, lost = alive.ask(), dead.ask()
        time.sleep(2.5)  # SQLite's clock has whole seconds
        alive.keep_alive()
        _, study = driver()  # opening the study fails stale RUNNING trials
        states = {config_key(t.params): t.state for t in study.trials}
        assert states == {config_key(kept): optuna.trial.TrialState.RUNNING,
                          config_key(lost): optuna.trial.TrialState.FAIL}


def test_a_config_held_elsewhere_is_neither_a_failure_nor_proposed_again():
    d, study = _driver(Strategy.TPE, budget=3)
    held = d.ask()
    d.measured_elsewhere(held)
    assert config_key(held) not in d.measured and d.remaining() == 3
    (trial,) = study.trials
    # FAIL is the state TPE ignores; the mark says why (no variant failed).
    assert trial.state == optuna.trial.TrialState.FAIL
    assert trial.user_attrs == {"measured_elsewhere": True}
    out = [d.ask() for _ in range(3)]
    assert None not in out and config_key(held) not in {config_key(c) for c in out}
    assert d.ask() is None


def test_configs_taken_from_the_queue_count_against_the_budget():
    d, _ = _driver(Strategy.RANDOM, budget=3)
    queued = list(SPACE.grid())[:2]
    for c in queued:
        d.taken(c)
    assert d.remaining() == 1 and d.has_room()
    asked = d.ask()
    assert config_key(asked) not in {config_key(c) for c in queued}
    assert d.ask() is None and not d.has_room()
    for c in [*queued, asked]:
        d.tell(c, _cost(c))
    assert len(d.measured) == 3 and d.ask() is None


def test_reconcile_tells_the_study_the_stored_results_it_lacks():
    """A sweep killed between storing a trial and telling Optuna left the study short: the
    stored results are told once, and told results, foreign points and other sweeps'
    proposals are left as they are."""
    grid = list(SPACE.grid())
    d, study = _driver(Strategy.TPE)
    first = d.ask()
    d.tell(first, 7.0)  # told: COMPLETE
    held = d.ask()
    d.measured_elsewhere(held)  # FAIL, marked: not a result of its own
    failed = next(c for c in grid if c not in (first, held))
    stored = {config_key(first): 7.0, config_key(held): 3.0, config_key(failed): None,
              config_key({"bn": 128, "splits": 1}): 2.0}  # not a point of this space
    assert d.reconcile(stored) == 2
    by_key = {}
    for t in study.trials:
        by_key.setdefault(config_key(t.params), []).append((t.state.name, t.value))
    assert by_key[config_key(first)] == [("COMPLETE", 7.0)]
    assert sorted(by_key[config_key(held)], key=str) == [("COMPLETE", 3.0), ("FAIL", None)]
    assert by_key[config_key(failed)] == [("FAIL", None)]
    again = SearchDriver(study, SPACE, grid, Strategy.TPE, None, stored)
    assert again.reconcile(stored) == 0 and len(study.trials) == 4


def test_the_budget_counts_what_other_sweeps_spent():
    d, _ = _driver(Strategy.TPE, budget=4)
    assert d.ask() is not None and d.remaining() == 3
    d.note_spent(3)  # this driver's one, and two of other sweeps
    assert d.has_room() and d.remaining() == 1
    d.note_spent(4)
    assert not d.has_room() and d.ask() is None
