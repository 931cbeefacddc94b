import os
import signal
import sqlite3
from contextlib import closing

import optuna
import pytest
import torch
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from mla_tune.backends import get_backend, register
from mla_tune.cli.main import app
from mla_tune.db import TrialResult, TuningStore
from mla_tune.problem.shapes import Shape
from mla_tune.tuning.search import Strategy
from mla_tune.tuning.space import config_key
from mla_tune.tuning.sweep import SweepInterrupted, SweepOptions, run_sweep
from mla_tune.tuning.timing import TimingPolicy
from tests.db.faults import disk_full_after, fill, integrity, overwrite_pages, truncate

FAST = TimingPolicy(warmup=1, min_runs=3, max_runs=5, budget_s=0.05)


@pytest.fixture()
def store(tmp_path):
    register("toy", "tests.fixtures.toy_backends:ToyBackend")
    return TuningStore(f"sqlite:///{tmp_path / 't.db'}")


def test_sweep_records_every_outcome_and_picks_fastest_correct(store):
    shape = Shape(2, (7, 12))
    results = run_sweep([shape], [get_backend("toy")], store,
                        SweepOptions(policy=FAST, baselines=False))
    trials = store.trials(shape_key=shape.key)
    assert len(trials) == 12
    by_mode = {}
    for t in trials:
        by_mode.setdefault(t.config["mode"], set()).add(t.status)
    assert by_mode == {"ok": {"ok"}, "wrong": {"wrong"}, "raise": {"failed"}, "nan": {"wrong"}}
    failed = [t for t in trials if t.status == "failed"]
    assert all("toy variant failed to compile" in t.error for t in failed)
    wrong = [t for t in trials if t.config["mode"] == "wrong"]
    assert all(t.max_abs_err > 0 and t.mismatch_frac > 0 for t in wrong)
    w = results[0].winner
    assert w.backend == "toy" and w.config == {"delay_ms": 0, "mode": "ok"}
    ok_times = sorted(t.median_us for t in trials if t.status == "ok")
    assert w.median_us == ok_times[0] and ok_times[-1] > 3000


def test_rerun_reuses_trials(store):
    shape = Shape.uniform(2, 8)
    opts = SweepOptions(policy=FAST, baselines=False)
    run_sweep([shape], [get_backend("toy")], store, opts)
    before = [(t.id, t.median_us) for t in store.trials()]
    again = run_sweep([shape], [get_backend("toy")], store, opts)
    assert [(t.id, t.median_us) for t in store.trials()] == before
    assert again[0].backends[0].new_trials == 0 and again[0].backends[0].reused_trials == 12


def test_budget_limits_new_measurements(store):
    shape = Shape.uniform(1, 8)
    run_sweep([shape], [get_backend("toy")], store,
              SweepOptions(policy=FAST, baselines=False, budget=4))
    assert len(store.trials(shape_key=shape.key)) == 4


def test_sampled_search_claims_what_it_measures_and_leaves_no_running_trial(store):
    shape = Shape.uniform(2, 8)
    results = run_sweep([shape], [get_backend("toy")], store,
                        SweepOptions(policy=FAST, baselines=False, budget=5,
                                     strategy=Strategy.TPE))
    trials = store.trials(shape_key=shape.key)
    assert len(trials) == 5 and len({t.config_key for t in trials}) == 5
    assert results[0].backends[0].new_trials == 5
    summaries = optuna.get_all_study_summaries(store.optuna_storage())
    study = optuna.load_study(study_name=summaries[0].study_name,
                              storage=store.optuna_storage())
    states = {t.state for t in study.trials}
    assert optuna.trial.TrialState.RUNNING not in states
    complete = {config_key(t.params) for t in study.trials
                if t.state == optuna.trial.TrialState.COMPLETE}
    assert complete == {t.config_key for t in trials if t.status == "ok"}


def test_software_fingerprint_does_not_depend_on_the_backends_swept(store, monkeypatch):
    import mla_tune.backends as registry

    monkeypatch.setitem(registry._REGISTRY, "toylib", "tests.fixtures.toy_backends:ToyLibraryBackend")
    shape = Shape.uniform(1, 8)
    opts = SweepOptions(policy=FAST, baselines=False, budget=1)
    run_sweep([shape], [get_backend("toylib")], store, opts)
    run_sweep([shape], [get_backend("toy")], store, opts)
    assert len({t.software_id for t in store.trials()}) == 1


def _group_of(store, shape):
    """The queue key a sweep used for `shape` with the toy backend (from its trials)."""
    from mla_tune.db import TrialGroup

    t = store.trials(shape_key=shape.key)[0]
    return TrialGroup(t.device_id, t.software_id, shape.key, "toy", t.source_hash)


def test_sampled_search_counts_queued_claims_against_the_budget(store):
    """Candidates left queued by a grid run or a stopped sweep are claimed only while the
    budget allows, and the sweep finishes with the rest still queued."""
    shape = Shape.uniform(1, 8)
    toy = get_backend("toy")
    run_sweep([shape], [toy], store, SweepOptions(policy=FAST, baselines=False, budget=1))
    group = _group_of(store, shape)
    store.enqueue(group, toy.candidates(shape, torch.device("cpu")))
    assert len(store.claims(group)) == 11
    for strategy in (Strategy.TPE, Strategy.RANDOM):
        run_sweep([shape], [toy], store, SweepOptions(policy=FAST, baselines=False, budget=4,
                                                     strategy=strategy))
        trials = store.trials(shape_key=shape.key)
        assert len(trials) == 4 and len({t.config_key for t in trials}) == 4
        left = store.claims(group)
        assert len(left) == 8 and {c.state for c in left} == {"pending"}


def test_a_proposal_another_sweep_holds_is_not_recorded_as_a_failure(store):
    """The one candidate is claimed by a live sweep on another machine just before the
    sampler proposes it: the proposal is closed without a failure that TPE or our table
    would keep, and once the holder's claim goes stale this sweep takes it over."""
    from mla_tune.backends import library_versions
    from mla_tune.db import TrialGroup
    from mla_tune.machine.fingerprint import current_device, current_software

    shape = Shape.uniform(1, 8)
    toy = get_backend("toy")
    only = {"delay_ms": 0, "mode": "ok"}
    pins = {"toy": {k: [v] for k, v in only.items()}}
    dev = torch.device("cpu")

    class ClaimElsewhere:  # runs as the group opens, before this sweep claims anything
        def shape_started(self, *a): ...
        def trial_done(self, *a): ...
        def shape_done(self, *a): ...

        def backend_started(self, shape, backend, todo):
            group = TrialGroup(store.device_id(current_device(dev)),
                               store.software_id(current_software(library_versions(dev))),
                               shape.key, backend, toy.source_hash())
            assert store.claim(group, "elsewhere/boot/1", stale_after_s=60, config=only)

    run_sweep([shape], [toy], store,
              SweepOptions(policy=FAST, baselines=False, strategy=Strategy.TPE, pins=pins,
                           heartbeat_s=0.5, stale_after_s=1.5), ClaimElsewhere())
    trials = store.trials(shape_key=shape.key)
    assert [(t.config, t.status) for t in trials] == [(only, "ok")]
    storage = store.optuna_storage()
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    mine = sorted(((t.state.name, t.value, t.user_attrs.get("measured_elsewhere", False))
                   for t in study.trials if t.params == only), key=str)
    assert mine == [("COMPLETE", trials[0].median_us, False), ("FAIL", None, True)], mine


def test_each_worker_keeps_to_a_shape_of_its_own(store):
    """Workers regenerate input and reference when they change shape, so the sweep hands
    each worker candidates of the shape it holds, opens a new shape for an idle worker
    rather than sending it to another worker's shape, and shares shapes only at the end."""
    from mla_tune.backends import library_versions
    from mla_tune.machine.fingerprint import current_device, current_software
    from mla_tune.tuning.sweep import _Sweep

    dev = torch.device("cpu")
    shapes = [Shape.uniform(1, 8), Shape.uniform(2, 8)]
    pins = {"toy": {"mode": ["ok"], "delay_ms": [0, 2]}}  # two candidates per shape
    sweep = _Sweep(shapes, [get_backend("toy")], {}, store,
                   SweepOptions(policy=FAST, baselines=False, pins=pins), None, None,
                   current_device(dev), current_software(library_versions(dev)))
    picked = []
    for slot in (0, 1, 0, 1):
        group, _ = sweep._next_job(slot)
        sweep.holds[slot] = group.shape.key
        group.running += 1
        picked.append((slot, group.shape.key))
    assert picked == [(0, shapes[0].key), (1, shapes[1].key), (0, shapes[0].key),
                      (1, shapes[1].key)]
    assert sweep._next_job(0) is None  # nothing left to claim anywhere


def test_retry_measures_failed_trials_again_and_only_when_asked(store, tmp_path, monkeypatch):
    from tests.fixtures.fault_backends import FLAKY_FILE_ENV

    register("flaky", "tests.fixtures.fault_backends:FlakyBackend")
    marker = tmp_path / "busy"
    marker.touch()
    monkeypatch.setenv(FLAKY_FILE_ENV, str(marker))
    shape = Shape.uniform(2, 8)
    backend = get_backend("flaky")
    opts = SweepOptions(policy=FAST, baselines=False)
    run_sweep([shape], [backend], store, opts)

    def outcomes() -> dict[tuple[str, int], str]:
        return {(t.config["kind"], t.config["delay_ms"]): t.status
                for t in store.trials(shape_key=shape.key)}
    assert outcomes() == {("steady", 0): "ok", ("steady", 4): "ok",
                          ("flaky", 0): "failed", ("flaky", 4): "failed"}
    steady_ids = {t.id for t in store.trials(status="ok")}

    marker.unlink()  # the transient cause is gone
    again = run_sweep([shape], [backend], store, opts)
    assert again[0].backends[0].new_trials == 0  # a stored outcome is never re-measured...
    assert set(outcomes().values()) == {"ok", "failed"}

    retried = run_sweep([shape], [backend], store,
                        SweepOptions(policy=FAST, baselines=False, retry=("failed",)))
    assert retried[0].backends[0].new_trials == 2  # ...unless asked to
    assert set(outcomes().values()) == {"ok"}
    assert steady_ids <= {t.id for t in store.trials(status="ok")}  # 'ok' trials kept
    assert retried[0].winner.config["delay_ms"] == 0


def test_retry_refuses_to_delete_ok_trials(store):
    from mla_tune.db import TrialGroup

    with pytest.raises(ValueError, match="failed, timeout or wrong"):
        store.delete_trials(TrialGroup(1, 1, "k", "toy", "src"), ("ok",))


def test_a_shape_is_finished_as_soon_as_its_last_trial_is_stored(store):
    """A worker moves on to the next shape before its last result of this one is stored, so
    the shape must be finished when that result is stored, not when the worker later asks
    for more: otherwise a sweep stopped while the next shape runs leaves a fully measured
    shape without its winner."""
    events = []

    class Log:
        def shape_started(self, shape, *a): ...
        def backend_started(self, *a): ...
        def trial_done(self, shape, *a): events.append(("trial", shape.key))
        def shape_done(self, result): events.append(("done", result.shape.key))

    shapes = [Shape.uniform(1, 8), Shape.uniform(2, 8)]
    pins = {"toy": {"mode": ["ok"], "delay_ms": [0, 2]}}
    run_sweep(shapes, [get_backend("toy")], store,
              SweepOptions(policy=FAST, baselines=False, pins=pins), Log())
    first, second = (s.key for s in shapes)
    assert events.index(("done", first)) < events.index(("trial", second)), events


def _set_medians(store, shape, medians):
    """Overwrite stored first times, as if they had been measured in another moment."""
    import sqlite3

    from mla_tune.db import resolve_url

    conn = sqlite3.connect(resolve_url(store.url).database)
    for t in store.trials(shape_key=shape.key):
        if t.status == "ok":
            conn.execute("UPDATE mt_trials SET median_us = ? WHERE id = ?",
                         (medians[t.config["delay_ms"]], t.id))
    conn.commit()
    conn.close()


def test_runoff_picks_the_winner_from_finalists_timed_side_by_side(store):
    shape = Shape.uniform(2, 8)
    toy = get_backend("toy")
    run_sweep([shape], [toy], store, SweepOptions(policy=FAST, baselines=False, runoff=0))
    assert all(t.remeasured_at is None for t in store.trials())
    # First times that rank the slowest variant first, all within the run-off's window:
    # what a device's slow and fast moments can do to close variants timed one by one.
    _set_medians(store, shape, {4: 1000.0, 2: 1001.0, 0: 1002.0})
    assert run_sweep([shape], [toy], store,
                     SweepOptions(policy=FAST, baselines=False, runoff=0))[0].winner.config[
        "delay_ms"] == 4
    (res,) = run_sweep([shape], [toy], store, SweepOptions(policy=FAST, baselines=False))
    assert res.side_by_side == 3 and res.backends[0].new_trials == 0
    ok = {t.config["delay_ms"]: t for t in store.trials() if t.status == "ok"}
    assert {d: t.first_median_us for d, t in ok.items()} == {4: 1000.0, 2: 1001.0, 0: 1002.0}
    assert len({t.remeasured_at for t in ok.values()}) == 1 and ok[0].remeasured_at
    side = {d: t.runoff_median_us for d, t in ok.items()}
    assert side[0] < 1000 and 2000 < side[2] < 4000 < side[4]
    # Each keeps its better timing: the run-off's for delay 0, the (flattering) first for
    # the others, which still lose to delay 0's true time.
    assert {d: t.median_us for d, t in ok.items()} == {0: side[0], 2: 1001.0, 4: 1000.0}
    assert res.winner.config == {"delay_ms": 0, "mode": "ok"}
    assert (res.winner.trial_id, res.winner.median_us) == (ok[0].id, side[0])
    # Already timed together: a later sweep keeps that run and its winner.
    (again,) = run_sweep([shape], [toy], store, SweepOptions(policy=FAST, baselines=False))
    assert again.side_by_side == 3
    assert (again.winner.trial_id, again.winner.median_us) == (ok[0].id, ok[0].median_us)
    assert [t.remeasured_at for t in store.trials() if t.status == "ok"] == [
        t.remeasured_at for t in ok.values()]


def test_the_formats_of_one_call_run_off_together_once(store):
    """The winners the dispatcher's format choice compares are timed in one run: each
    format's finalists, built for that format and checked against its own reference."""
    call = Shape.uniform(2, 8)
    shapes = [call, call.with_format("fp8")]
    toy = get_backend("toy")
    pins = {"toy": {"mode": ["ok"]}}
    run_sweep(shapes, [toy], store,
              SweepOptions(policy=FAST, baselines=False, pins=pins, runoff=0))
    # First times from other moments: fp8's slowest variant looks the fastest of all.
    _set_medians(store, shapes[0], {0: 1002.0, 2: 1003.0, 4: 1004.0})
    _set_medians(store, shapes[1], {0: 1001.0, 2: 1001.5, 4: 1000.0})
    results = run_sweep(shapes, [toy], store,
                        SweepOptions(policy=FAST, baselines=False, pins=pins))
    ok = [t for t in store.trials() if t.status == "ok"]
    assert len(ok) == 6 and {t.kv_format for t in ok} == {"bf16", "fp8"}
    assert len({t.remeasured_at for t in ok}) == 1 and ok[0].remeasured_at is not None
    assert [r.side_by_side for r in results] == [3, 3]
    assert [r.winner.config["delay_ms"] for r in results] == [0, 0]
    assert all(r.winner.median_us < 1000 for r in results)
    # Timed together already: the same sweep again times nothing.
    again = run_sweep(shapes, [toy], store, SweepOptions(policy=FAST, baselines=False, pins=pins))
    assert [t.remeasured_at for t in store.trials() if t.status == "ok"] == [
        t.remeasured_at for t in ok]
    assert [r.winner.trial_id for r in again] == [r.winner.trial_id for r in results]
    # One format alone is run off on its own, as before.
    (alone,) = run_sweep([shapes[1]], [toy], store,
                         SweepOptions(policy=FAST, baselines=False, pins=pins))
    assert alone.side_by_side == 3


def test_a_finalist_wrong_when_timed_again_cannot_win(store, tmp_path, monkeypatch):
    from tests.fixtures.toy_backends import FLAKY_ENV

    register("flaky", "tests.fixtures.toy_backends:FlakyBackend")
    flag = tmp_path / "now-wrong"
    monkeypatch.setenv(FLAKY_ENV, str(flag))
    shape = Shape.uniform(2, 8)
    flaky = get_backend("flaky")
    run_sweep([shape], [flaky], store, SweepOptions(policy=FAST, baselines=False, runoff=0))
    _set_medians(store, shape, {0: 1000.0, 2: 1001.0})
    flag.touch()
    (res,) = run_sweep([shape], [flaky], store, SweepOptions(policy=FAST, baselines=False))
    trials = {t.config["delay_ms"]: t for t in store.trials()}
    assert trials[0].status == "wrong" and "wrong when built again" in trials[0].error
    assert trials[0].first_median_us == 1000.0 and trials[0].median_us is None
    assert trials[2].remeasured_at is not None and trials[2].first_median_us == 1001.0
    assert res.winner.config["delay_ms"] == 2 and res.side_by_side == 1
    flag.unlink()  # even when it would pass again, a later sweep does not pick it
    (again,) = run_sweep([shape], [flaky], store, SweepOptions(policy=FAST, baselines=False))
    assert again.winner.config["delay_ms"] == 2


# ------------------------------------------------------------ the sweep command on a bad DB
runner = CliRunner()
CLI_FAST = ["--device", "cpu", "--backend", "torch", "--no-baseline", "-f", "bf16",
            "--runoff", "0", "--time-budget", "0.01"]


def _said(result):
    """The command's output with line breaks undone (rich wraps at the terminal width)."""
    return " ".join(result.output.split())


@pytest.mark.parametrize("damage", [truncate, lambda p: overwrite_pages(p, first=12)],
                         ids=["truncated", "garbage-pages"])
def test_sweep_on_a_damaged_db_exits_2_and_leaves_it_as_it_was(tmp_path, damage):
    db = tmp_path / "tuning.db"
    fill(db)
    damage(db)
    payload = db.read_bytes()
    r = runner.invoke(app, ["sweep", "--db", str(db), "--shape", "2x32", *CLI_FAST])
    assert r.exit_code == 2, r.output
    assert "is damaged" in _said(r) and ".recover" in _said(r) and "Traceback" not in r.output
    assert db.read_bytes() == payload


def test_a_full_disk_stops_the_sweep_with_exit_2_and_the_same_command_finishes(store, tmp_path):
    db, key = tmp_path / "tuning.db", "b2-q1-kv8-h16-bf16-p1"
    toy = ["--device", "cpu", "--backend", "toy", "--no-baseline", "-f", "bf16", "--runoff", "0",
           "--time-budget", "0.01"]
    # The DB, its device, stack and Optuna tables exist before the disk fills up.
    first = runner.invoke(app, ["sweep", "--db", str(db), "--shape", "2x4", *toy])
    assert first.exit_code == 0, first.output
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("VACUUM")  # no free pages left: the first row that needs one fails
    args = ["sweep", "--db", str(db), "--shape", "2x8", *toy]
    with disk_full_after(pages=0):
        r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "is full" in _said(r) and "Nothing stored was lost" in _said(r)
    assert "Traceback" not in r.output and integrity(db) == ["ok"]
    with TuningStore(str(db)) as s:
        before = [t.config_key for t in s.trials(shape_key=key)]
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    with TuningStore(str(db)) as s:
        after = [t.config_key for t in s.trials(shape_key=key)]
        assert s.winners(shape_key=key)
    assert len(after) == len(set(after)) == 12 and set(before) < set(after)


# ------------------------------------------------------------ sweeps sharing a DB and a study
def _study(store):
    storage = store.optuna_storage()
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def _complete(study):
    return {config_key(t.params): t.value for t in study.trials
            if t.state == optuna.trial.TrialState.COMPLETE}


def test_a_stop_landing_right_after_a_trial_is_stored_still_tells_the_study(store):
    """Ctrl-C arrives the moment a trial's transaction commits: the sweep stops after
    telling Optuna that trial, so the study holds every stored time."""
    shape = Shape.uniform(1, 8)
    inserted = []

    def note(conn, cursor, statement, *args):
        if statement.startswith("INSERT INTO mt_trials"):
            inserted.append(True)

    def interrupt(session):
        if len(inserted) == 2:  # the second trial is stored now
            inserted.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    event.listen(Engine, "after_cursor_execute", note)
    event.listen(Session, "after_commit", interrupt)
    try:
        with pytest.raises(SweepInterrupted) as stop:
            run_sweep([shape], [get_backend("toy")], store,
                      SweepOptions(policy=FAST, baselines=False, strategy=Strategy.TPE,
                                   budget=6))
    finally:
        event.remove(Engine, "after_cursor_execute", note)
        event.remove(Session, "after_commit", interrupt)
    trials = store.trials(shape_key=shape.key)
    assert len(trials) == stop.value.new_trials == 2
    assert {t.config_key: t.median_us for t in trials if t.status == "ok"}.items() \
        <= _complete(_study(store)).items()
    assert {t.config_key for t in trials} <= {config_key(t.params) for t in _study(store).trials
                                              if t.state.is_finished()}


def test_a_stored_trial_the_study_lacks_is_told_when_its_group_opens(store):
    """A sweep killed (SIGKILL) between storing a trial and telling Optuna: the next sweep
    of the group tells the study, once the trial is older than a live sweep's window."""
    shape = Shape.uniform(1, 8)
    toy = get_backend("toy")
    opts = SweepOptions(policy=FAST, baselines=False, strategy=Strategy.TPE, budget=2)
    run_sweep([shape], [toy], store, opts)
    group = _group_of(store, shape)
    told = _complete(_study(store))
    lost = next(c for c in toy.candidates(shape, torch.device("cpu"))
                if c["mode"] == "ok" and config_key(c) not in told)
    store.record_trial(group, TrialResult(shape.to_json(), "bf16", lost, "ok",
                                          stats={"median_us": 123.0}))
    run_sweep([shape], [toy], store, opts)  # a trial stored just now is a live sweep's
    assert config_key(lost) not in _complete(_study(store))
    with closing(sqlite3.connect(store.url.removeprefix("sqlite:///"))) as conn, conn:
        conn.execute("UPDATE mt_trials SET created_at = datetime('now', '-1 hour')")
    run_sweep([shape], [toy], store, opts)
    study = _study(store)
    assert _complete(study)[config_key(lost)] == 123.0
    assert sum(config_key(t.params) == config_key(lost) for t in study.trials) == 1
    assert len(store.trials(shape_key=shape.key)) == 3  # nothing measured beyond the budget


def test_the_budget_is_shared_with_a_sweep_measuring_the_same_group(store):
    """Another live sweep holds one candidate of the group while this one runs with
    --budget 2: together they measure 2 configs, not 2 each."""
    from mla_tune.backends import library_versions
    from mla_tune.db import TrialGroup
    from mla_tune.machine.fingerprint import current_device, current_software

    shape = Shape.uniform(1, 8)
    toy = get_backend("toy")
    theirs = {"delay_ms": 4, "mode": "ok"}
    dev = torch.device("cpu")

    class OtherSweep:
        """Claims `theirs` as the group opens, and stores it after this sweep's first
        result, as a sweep on another machine would."""

        group = None

        def shape_started(self, *a): ...
        def shape_done(self, *a): ...

        def backend_started(self, shape, backend, todo):
            self.group = TrialGroup(store.device_id(current_device(dev)),
                                    store.software_id(current_software(library_versions(dev))),
                                    shape.key, backend, toy.source_hash())
            assert store.claim(self.group, "elsewhere/boot/1", stale_after_s=60, config=theirs)

        def trial_done(self, shape, backend, config, outcome, best):
            if store.claims(self.group):
                store.record_trial(self.group, TrialResult(
                    shape.to_json(), "bf16", theirs, "ok", stats={"median_us": 4000.0},
                    worker="elsewhere"))

    run_sweep([shape], [toy], store,
              SweepOptions(policy=FAST, baselines=False, strategy=Strategy.TPE, budget=2),
              OtherSweep())
    trials = store.trials(shape_key=shape.key)
    assert len(trials) == 2 and theirs in [t.config for t in trials]
