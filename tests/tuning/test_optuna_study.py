"""`mla_tune.tuning.optuna_study`: our studies in the tuning DB are named, found, heartbeated and
deleted through one module, and other tools' studies there are left alone."""

import optuna

from mla_tune.db import TuningStore
from mla_tune.tuning.optuna_study import (
    delete_studies,
    heartbeat_enabled,
    open_study,
    study_name,
    study_source,
    study_sources,
)
from mla_tune.tuning.search import Strategy, make_sampler

SHAPE_KEY = "b4-q1-kv1024-h16-bf16-p1"


def test_study_names_round_trip_and_foreign_studies_are_ignored() -> None:
    assert study_source(study_name("d", "s", SHAPE_KEY, "triton", "abc")) == ("triton", "abc")
    assert study_source("someone-elses-study") is None
    assert study_source("mla-tune:too:few") is None


def test_our_studies_are_found_and_deleted_and_foreign_ones_kept(tmp_path) -> None:
    with TuningStore(str(tmp_path / "t.db")) as store:
        storage = store.optuna_storage()
        ours = [study_name("d", "s", SHAPE_KEY, "triton", h) for h in ("a1", "a2")]
        for name in ours:
            study = open_study(storage, name, make_sampler(Strategy.TPE, 0))
            study.add_trial(optuna.trial.create_trial(value=1.0))
        optuna.create_study(storage=storage, study_name="not-ours")
        again = open_study(storage, ours[0], make_sampler(Strategy.TPE, 0))  # loaded
        assert len(again.trials) == 1 and again.direction == optuna.study.StudyDirection.MINIMIZE
        assert study_sources(storage) == {ours[0]: ("triton", "a1"), ours[1]: ("triton", "a2")}
        assert delete_studies(storage, ours[:1]) == 1
    with TuningStore(str(tmp_path / "t.db")) as store:
        names = {s.study_name for s in store.optuna_storage().get_all_studies()}
    assert names == {ours[1], "not-ours"}


def test_heartbeats_are_on_only_when_the_storage_was_opened_with_them(tmp_path) -> None:
    with TuningStore(str(tmp_path / "t.db")) as store:
        sampler = make_sampler(Strategy.RANDOM, 0)
        plain = open_study(store.optuna_storage(), "plain", sampler)
        beating = open_study(store.optuna_storage(heartbeat_s=1, grace_s=2), "beating", sampler)
        assert not heartbeat_enabled(plain) and heartbeat_enabled(beating)
    assert not heartbeat_enabled(optuna.create_study())  # in memory: no heartbeats
