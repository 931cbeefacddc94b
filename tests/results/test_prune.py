"""`mla-tune prune`: which kernel sources are retired, and that deleting them keeps every
current result, the newest measured one, winners, and the DB readable."""

from __future__ import annotations

import json

import optuna
import pytest
from typer.testing import CliRunner

from mla_tune.backends import source_hashes
from mla_tune.cli.main import app
from mla_tune.db import SourceRow, TrialGroup, TrialResult, TuningStore
from mla_tune.results.prune import plan
from mla_tune.results.selection import update_winner
from mla_tune.tuning.optuna_study import study_name
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

runner = CliRunner()


def test_plan_keeps_current_and_newest_sources_and_what_winners_name() -> None:
    rows = [SourceRow("triton", "old", 10, 10, 0), SourceRow("triton", "mid", 5, 20, 5),
            SourceRow("triton", "cur", 4, 30, 0), SourceRow("triton", "edited", 3, 40, 0),
            SourceRow("aiter", "a1", 2, 5, 0), SourceRow("aiter", "a2", 2, 6, 0)]
    studies = {"s-old": ("triton", "old"), "s-cur": ("triton", "cur"),
               "s-gone": ("triton", "no-trials"), "s-a1": ("aiter", "a1")}
    retired = plan(rows, studies, {"triton": "cur"})
    # "edited" is the newest measured (the checkout changed since): kept. "mid" has only
    # winner-named trials and no study: nothing to delete. aiter cannot be loaded here:
    # its newest source stays, the older one goes.
    assert [(r.backend, r.source_hash, r.trials, r.studies) for r in retired] == [
        ("aiter", "a1", 2, ["s-a1"]), ("triton", "no-trials", 0, ["s-gone"]),
        ("triton", "old", 10, ["s-old"])]


OLD = "0000000000000001"  # an old source's hash (hex, as stored hashes are)


def _db(path) -> tuple[str, dict[str, str]]:
    """A DB with trials and studies of an old, the current and a foreign triton source,
    and a winner on the old one."""
    current = source_hashes()["triton"]
    store = TuningStore(str(path))
    dev, sw = store.device_id(GPU), store.software_id(STACK)
    names = {}
    storage = store.optuna_storage()
    for source, median in ((OLD, 5.0), (current, 7.0)):
        for i in range(3):
            store.record_trial(TrialGroup(dev, sw, SHAPE_KEY, "triton", source),
                               TrialResult(SHAPE, "bf16", {"i": i}, "ok",
                                           stats={"median_us": median + i}))
        names[source] = study_name("d", "s", SHAPE_KEY, "triton", source)
        study = optuna.create_study(storage=storage, study_name=names[source])
        study.add_trial(optuna.trial.create_trial(value=median))
    optuna.create_study(storage=storage, study_name="not-ours")
    update_winner(store, dev, sw, SHAPE_KEY, {"triton": OLD})
    store.close()
    return current, names


def test_cli_lists_then_deletes_retired_sources_only(tmp_path) -> None:
    path = tmp_path / "t.db"
    current, names = _db(path)

    dry = runner.invoke(app, ["prune", "--db", str(path)])
    assert dry.exit_code == 0, dry.output
    assert OLD[:12] in dry.output and "nothing deleted" in dry.output
    with TuningStore(str(path), read_only=True) as ro:
        assert len(ro.trials()) == 6

    done = runner.invoke(app, ["prune", "--db", str(path), "--yes"])
    assert done.exit_code == 0, done.output
    assert "deleted 2 trials" in done.output and "1 studies" in done.output
    with TuningStore(str(path)) as store:
        left = sorted((t.source_hash, t.config["i"]) for t in store.trials())
        assert left == sorted([(current, 0), (current, 1), (current, 2), (OLD, 0)])
        (winner,) = store.winners()
        assert (winner.source_hash, winner.config) == (OLD, {"i": 0})
        studies = {s.study_name for s in store.optuna_storage().get_all_studies()}
    assert studies == {names[current], "not-ours"}

    again = runner.invoke(app, ["prune", "--db", str(path), "--yes"])
    assert again.exit_code == 0 and "nothing to prune" in again.output


def test_cli_refuses_a_missing_db_and_creates_nothing(tmp_path) -> None:
    path = tmp_path / "absent.db"
    r = runner.invoke(app, ["prune", "--db", str(path), "--yes"])
    assert r.exit_code != 0
    assert "no tuning DB" in r.output
    assert not path.exists()


@pytest.mark.parametrize("args", [["--yes"], []])
def test_report_reads_the_same_winners_after_prune(tmp_path, args) -> None:
    path = tmp_path / "t.db"
    _db(path)
    before = runner.invoke(app, ["report", "--db", str(path), "--format", "json"])
    runner.invoke(app, ["prune", "--db", str(path), *args])
    after = runner.invoke(app, ["report", "--db", str(path), "--format", "json"])
    assert before.exit_code == after.exit_code == 0

    def winners(out: str) -> list:
        return sorted((r["shape_key"], r["backend"], r["median_us"]) for r in json.loads(out))
    assert winners(before.output) == winners(after.output) == [(SHAPE_KEY, "triton", 5.0)]


def test_doctor_points_at_prune_when_retired_trials_are_stored(tmp_path) -> None:
    path = tmp_path / "t.db"
    _db(path)  # 3 trials of "old": one named by a winner, so 2 are prunable
    with TuningStore(str(path)) as store:  # a newer source measured last keeps "old" retired
        store.record_trial(TrialGroup(1, 1, SHAPE_KEY, "triton", "00000000000000ff"),
                           TrialResult(SHAPE, "bf16", {"i": 0}, "ok", stats={"median_us": 1.0}))
    r = runner.invoke(app, ["doctor", "--db", str(path), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "2 stored trials are of retired kernel sources" in r.output
    runner.invoke(app, ["prune", "--db", str(path), "--yes"])
    r = runner.invoke(app, ["doctor", "--db", str(path), "--device", "cpu"])
    assert "retired" not in r.output
