"""Winners files: export from a real swept DB, strict loading, import, and the dispatcher
reading a file exactly as it reads the DB."""

import json
import logging
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mla_tune.results.winners_file as winners_json
from mla_tune.cli.main import app
from mla_tune.db import TrialGroup, TrialResult, TuningStore
from mla_tune.machine.fingerprint import SoftwareFingerprint, current_device
from mla_tune.results.selection import update_winner
from mla_tune.problem.shapes import Shape, generate_input
from mla_tune.results.winners_file import (
    WinnersFileError,
    export_winners,
    import_winners,
    load_winners_json,
    parse_winners,
    records_from_store,
)
from mla_tune.runtime.dispatcher import Dispatcher
from tests.fixtures.sweep_db import swept_db

# The same shapes as test_dispatch.py: the sweep fixture runs once per test process.
SHAPES = [Shape.uniform(2, 64), Shape.uniform(4, 256), Shape.uniform(4, 256, kv_format="fp8")]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A real swept DB (torch family on CPU) and its export."""
    root = tmp_path_factory.mktemp("winners")
    db, path = root / "tuning.db", root / "winners.json"
    with swept_db(db, SHAPES) as store:
        assert export_winners(store, path) == 3
    return db, path


def test_round_trip_db_to_file_to_records(tuned):
    db, path = tuned
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], len(doc["winners"])) == ("mla-tune-winners", 2, 3)
    records = load_winners_json(path)
    with TuningStore(str(db)) as store:
        assert records == records_from_store(store)
        rows = store.winners()
    assert [replace(r, verified_ok=(), verified_wrong=()) for r in records] == rows
    # Each winner was verified at its own shape by the sweep that made it the winner.
    assert all(r.shape in r.verified_ok for r in records)
    assert parse_winners(json.loads(json.dumps(doc))) == records
    here = current_device("cpu").hash
    with TuningStore(str(db)) as store:
        assert export_winners(store, path.with_name("mine.json"), device_hash=here) == 3
        assert export_winners(store, path.with_name("none.json"), device_hash="0" * 16) == 0
    assert load_winners_json(path.with_name("none.json")) == []


def test_dispatcher_from_file_routes_like_from_db(tuned):
    db, path = tuned
    a, b = Dispatcher.from_db(str(db), "cpu"), Dispatcher.from_json(path, "cpu")
    shapes = [s.with_format(f) for s in (Shape.uniform(2, 64), Shape.uniform(8, 512),
                                         Shape.uniform(4, 128, heads=32))
              for f in ("bf16", "fp8", "mxfp4")]
    assert [a.decisions(s) for s in shapes] == [b.decisions(s) for s in shapes]
    assert b.decide(SHAPES[0]).reason == "exact" and b.loaded == 3


def test_import_into_an_empty_db_reproduces_the_winners_and_is_idempotent(tuned, tmp_path):
    db, path = tuned
    target = tmp_path / "imported.db"
    with TuningStore(str(target)) as store:
        summary = import_winners(store, path)
        assert (summary.trials, summary.won, summary.not_current) == (3, 3, 0)
        n_trials = len(store.trials())
        again = import_winners(store, path)
        assert again.trials == 3 and len(store.trials()) == n_trials
        imported = store.winners()
    with TuningStore(str(db)) as store:
        original = store.winners()
    assert imported == original  # the same winners; ids and times are the DB's own


def test_a_slower_retiming_wins_only_when_imported_to_replace_the_timings(tuned, tmp_path):
    """A file re-timing one winner 3x slower (as a protocol change may): imported plainly,
    the faster stored time keeps winning; with --replace-timings the shape's stored timings
    go, its other trials (all configs of the swept group) included, and the new time
    stands. Other shapes keep theirs."""
    import shutil

    db, path = tuned
    doc = json.loads(path.read_text())
    slow = doc["winners"][0]
    slow["median_us"] *= 3
    retimed = tmp_path / "retimed.json"
    retimed.write_text(json.dumps({**doc, "winners": [slow]}))
    for replace_flag in (False, True):
        target = tmp_path / f"db{int(replace_flag)}.db"
        shutil.copy(db, target)
        with TuningStore(str(target)) as store:  # the same shape timed under another stack
            w0 = next(w for w in store.winners() if w.shape.key == slow["shape_key"])
            other = SoftwareFingerprint(w0.software.versions + (("flashinfer", "0.0"),))
            dev, sw = store.device_id(w0.device), store.software_id(other)
            store.record_trial(TrialGroup(dev, sw, w0.shape.key, w0.backend, w0.source_hash),
                               TrialResult(w0.shape.to_json(), w0.shape.kv_format.value,
                                           w0.config, "ok", {"median_us": 0.5}))
            update_winner(store, dev, sw, w0.shape.key, {w0.backend: w0.source_hash})
        args = ["import", str(retimed), "--db", str(target)]
        r = CliRunner().invoke(app, args + (["--replace-timings"] if replace_flag else []))
        assert r.exit_code == 0, r.output
        with TuningStore(str(target)) as store:
            won = {w.shape.key: w.median_us for w in store.winners() if w.software != other}
            others = [w.median_us for w in store.winners() if w.software == other]
            timed = [t for t in store.trials(shape_key=slow["shape_key"]) if t.status == "ok"]
        with TuningStore(str(db)) as store:
            before = {w.shape.key: w.median_us for w in store.winners()}
        assert won[slow["shape_key"]] == pytest.approx(
            slow["median_us"] if replace_flag else before[slow["shape_key"]])
        assert others == ([] if replace_flag else [0.5])  # every stack's timings go
        assert {k: v for k, v in won.items() if k != slow["shape_key"]} == {
            k: v for k, v in before.items() if k != slow["shape_key"]}
        if replace_flag:
            assert [t.median_us for t in timed] == [pytest.approx(slow["median_us"])]


def test_imported_winner_of_stale_sources_is_kept_as_data_but_cannot_win(tuned, tmp_path):
    _, path = tuned
    doc = json.loads(path.read_text())
    doc["winners"][0]["source_hash"] = "00000000deadbeef"
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(doc))
    with TuningStore(str(tmp_path / "s.db")) as store:
        summary = import_winners(store, stale)
        assert (summary.trials, summary.won, summary.not_current) == (3, 2, 1)
        # Each winner's trial, plus a 'wrong' trial per shape a winner was verified wrong on
        # (which winner the CPU timings pick decides whether there are any).
        wrong = sum(len(w.get("verified_wrong", [])) for w in doc["winners"])
        statuses = sorted(t.status for t in store.trials())
        assert statuses == ["ok"] * 3 + ["wrong"] * wrong and len(store.winners()) == 2


def _corrupt(doc, how):
    w = doc["winners"][0]
    if how == "extra top-level key":
        doc["run"] = "rm -rf /"
    elif how == "wrong format":
        doc["format"] = "something-else"
    elif how == "future version":
        doc["version"] = 3
    elif how == "shape key mismatch":
        w["shape_key"] = "b9-q1-kv9-h16-bf16-p1"
    elif how == "nested config value":
        w["config"]["num_splits"] = {"__import__": "os"}
    elif how == "bool batch":
        w["shape"]["batch"] = True
    elif how == "negative sm_count":
        w["device"]["sm_count"] = -1
    elif how == "missing backend":
        del w["backend"]
    elif how == "backend with path characters":
        w["backend"] = "../../evil"
    elif how == "zero median":
        w["median_us"] = 0
    elif how == "duplicate entry":
        doc["winners"].append(dict(w))
    elif how == "kv_lens of wrong length":
        w["shape"]["kv_lens"] = [64, 64, 64]
    return doc


CORRUPTIONS = ["extra top-level key", "wrong format", "future version", "shape key mismatch",
               "nested config value", "bool batch", "negative sm_count", "missing backend",
               "backend with path characters", "zero median", "duplicate entry",
               "kv_lens of wrong length"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_strict_validation_refuses_and_dispatcher_warns(tuned, tmp_path, how, caplog):
    _, path = tuned
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_corrupt(json.loads(path.read_text()), how)))
    with pytest.raises(WinnersFileError):
        load_winners_json(bad)
    d = Dispatcher.from_json(bad, "cpu")
    assert d.loaded == 0 and any("unusable" in r.message for r in caplog.records)
    assert d.decide(SHAPES[0]).reason == "heuristic"


@pytest.mark.parametrize("text", ["", "not json", '{"format": "mla-tune-winners", '
                                  '"version": 1, "winners": [], "winners": []}',
                                  '{"format": "mla-tune-winners", "version": 1, '
                                  '"winners": [{"median_us": NaN}]}', "[]", "\xff\xfe"])
def test_malformed_text_is_refused(tmp_path, text):
    bad = tmp_path / "bad.json"
    bad.write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff\xfe"
                    else b"\xff\xfe")
    with pytest.raises(WinnersFileError):
        load_winners_json(bad)


def test_missing_file_is_a_warning(tmp_path, caplog):
    d = Dispatcher.from_json(tmp_path / "absent.json", "cpu")
    assert d.loaded == 0 and any("unusable" in r.message for r in caplog.records)
    data = generate_input(Shape.uniform(2, 64))
    assert d.run(data).shape == (2, 16, 512)


@pytest.mark.parametrize("field, value, why", [
    ("backend", "nonexistent", "backend unknown or unavailable"),
    ("config", {"num_splits": 3, "chunk_size": 0, "compute_dtype": "float32"},
     "config outside its backend's space"),
    ("config", {"num_splits": 1}, "config outside its backend's space"),
])
def test_entries_the_dispatcher_cannot_use_are_skipped_with_a_warning(tuned, tmp_path, field,
                                                                      value, why, caplog):
    caplog.set_level(logging.WARNING)
    _, path = tuned
    doc = json.loads(path.read_text())
    doc["winners"][0][field] = value
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(doc))
    load_winners_json(odd)  # a well-formed file: the dispatcher decides what it can use
    d = Dispatcher.from_json(odd, "cpu")
    assert d.loaded == 2 and d.ignored == {why: 1}
    assert any("skipping winner" in r.message for r in caplog.records)


def test_imported_winner_under_the_bytes_hash_of_installed_sources_is_stored_current(
        tuned, tmp_path):
    from mla_tune.backends import get_backend

    _, path = tuned
    doc = json.loads(path.read_text())
    w = doc["winners"][0]
    backend = get_backend(w["backend"])
    assert w["source_hash"] == backend.source_hash()
    w["source_hash"] = backend.source_bytes_hash()  # as a file written before the code hash
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    with TuningStore(str(tmp_path / "o.db")) as store:
        summary = import_winners(store, old)
        assert (summary.trials, summary.won, summary.not_current) == (3, 3, 0)
        assert {t.source_hash for t in store.trials(backend=w["backend"])} == {
            backend.source_hash()}


def _special_file(tmp_path, kind):
    """A path that is no plain JSON file: a FIFO nobody writes to, /dev/zero, a
    directory, or a regular file whose JSON nests 100,000 deep / holds 5001-digit ints."""
    p = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev-zero":
        return Path("/dev/zero")
    elif kind == "directory":
        p.mkdir()
    elif kind == "deeply nested":
        p.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "huge integer":
        p.write_text('{"format": "mla-tune-winners", "version": ' + "9" * 5001 +
                     ', "winners": []}')
    elif kind == "over the size cap":
        with p.open("wb") as f:
            f.truncate(winners_json.MAX_FILE_BYTES + 1)
    return p


SPECIAL = ["fifo", "dev-zero", "directory", "deeply nested", "huge integer",
           "over the size cap"]


def _in_thread(fn):
    """Run `fn` with a deadline, so a reader that blocks fails the test instead of hanging."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the reader blocked"
    return box


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/zero").exists(),
                    reason="needs POSIX FIFOs and /dev/zero")
@pytest.mark.parametrize("kind", SPECIAL)
def test_special_files_and_hostile_json_are_refused_quickly(tmp_path, kind, caplog):
    p = _special_file(tmp_path, kind)
    box = _in_thread(lambda: load_winners_json(p))
    assert isinstance(box.get("error"), WinnersFileError), box
    box = _in_thread(lambda: Dispatcher.from_json(p, "cpu"))
    assert box["value"].loaded == 0
    assert any("unusable" in r.message for r in caplog.records)
    box = _in_thread(lambda: CliRunner().invoke(app, ["import", str(p), "--db",
                                                      str(tmp_path / "t.db")]))
    r = box["value"]
    assert r.exit_code == 2 and "cannot import" in r.output, r.output
    assert not (tmp_path / "t.db").exists()


@pytest.mark.parametrize("field, value", [("median_us", 10**400),
                                          ("config", {"num_splits": 10**400})])
def test_huge_integers_in_an_entry_are_refused(tuned, tmp_path, field, value):
    _, path = tuned
    doc = json.loads(path.read_text())
    doc["winners"][0][field] = value
    bad = tmp_path / "big.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(WinnersFileError, match=field):
        load_winners_json(bad)
