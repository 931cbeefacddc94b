import os
import sqlite3
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

from mla_tune.db import DBError, TuningStore, resolve_url
from mla_tune.db.models import VERSION_TABLE, Base, is_ours
from mla_tune.fingerprint import DeviceFingerprint, SoftwareFingerprint
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

REPO = Path(__file__).resolve().parents[2]
OUR_TABLES = {"mt_devices", "mt_software", "mt_trials", "mt_winners", "mt_claims",
              VERSION_TABLE}


def _stats(median):
    return {"median_us": median, "mean_us": median + 0.5, "std_us": 0.1,
            "min_us": median - 0.2, "max_us": median + 1.0, "n": 50}


def _record(store, ids, config, status="ok", median=10.0, backend="triton", source="src1",
            **kw):
    stats = _stats(median) if status == "ok" else None
    return store.record_trial(**ids, shape_key=SHAPE_KEY, shape_json=SHAPE, kv_format="bf16",
                              backend=backend, source_hash=source, config=config,
                              status=status, stats=stats, **kw)


def _tables(url):
    engine = create_engine(resolve_url(url))
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migrates_an_empty_file(tmp_path):
    path = tmp_path / "empty.db"
    path.touch()
    TuningStore(str(path)).close()
    conn = sqlite3.connect(path)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert tables == OUR_TABLES
    assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [("0003",)]
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    conn.close()


def test_models_match_migrations(store, url):
    engine = create_engine(resolve_url(url))
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"include_name": is_ours,
                                                     "version_table": VERSION_TABLE})
        assert compare_metadata(ctx, Base.metadata) == []
    engine.dispose()
    assert OUR_TABLES <= _tables(url)


def test_reopen_is_idempotent(url):
    for _ in range(2):
        TuningStore(url).close()
    assert OUR_TABLES <= _tables(url)


def test_fingerprint_rows_are_get_or_create(store):
    d = store.device_id(GPU)
    assert store.device_id(GPU) == d
    assert store.software_id(STACK) == store.software_id(STACK)
    other = DeviceFingerprint("amd", "MI355X", "gfx950", 256, 288 << 30)
    assert store.device_id(other) != d
    devices = store.devices()
    assert [r.fingerprint for r in devices] == [GPU, other]
    assert devices[0].hash == GPU.hash and devices[0].read_bw_gbps is None
    store.set_read_bandwidth(d, 4300.5)
    assert store.devices()[0].read_bw_gbps == 4300.5
    with pytest.raises(KeyError):
        store.set_read_bandwidth(12345, 1.0)


def test_trial_round_trip(store, ids):
    tid = _record(store, ids, {"BLOCK_N": 64, "num_warps": 4}, median=12.5, worker="h:gpu0",
                  max_abs_err=1e-3, mismatch_frac=0.0)
    _record(store, ids, {"BLOCK_N": 32, "num_warps": 4}, status="failed", error="OOM")
    [row] = store.trials(status="ok")
    assert row.id == tid
    assert row.config == {"BLOCK_N": 64, "num_warps": 4}
    assert row.config_key == '{"BLOCK_N":64,"num_warps":4}'
    assert row.shape_json == SHAPE and row.shape_key == SHAPE_KEY
    assert (row.median_us, row.mean_us, row.std_us, row.min_us, row.max_us, row.n) == (
        12.5, 13.0, 0.1, 12.3, 13.5, 50)
    assert (row.max_abs_err, row.mismatch_frac, row.worker) == (1e-3, 0.0, "h:gpu0")
    assert row.created_at.tzinfo is not None
    measured = store.measured(ids["device_id"], ids["software_id"], SHAPE_KEY, "triton", "src1")
    assert set(measured) == {'{"BLOCK_N":32,"num_warps":4}', '{"BLOCK_N":64,"num_warps":4}'}
    assert measured['{"BLOCK_N":32,"num_warps":4}'].error == "OOM"
    assert store.measured(ids["device_id"], ids["software_id"], SHAPE_KEY, "triton",
                          "src2") == {}
    assert len(store.trials(backend="triton", shape_key=SHAPE_KEY)) == 2
    assert store.trials(backend="flashinfer") == []


def test_duplicate_trial_keeps_the_first(store, ids):
    first = _record(store, ids, {"a": 1, "b": 2}, median=10.0)
    before = store.trials()
    again = _record(store, ids, {"b": 2, "a": 1}, status="failed", error="different")
    assert again == first
    assert store.trials() == before


def test_trial_validation(store, ids):
    with pytest.raises(ValueError, match="status"):
        _record(store, ids, {"a": 1}, status="great")
    with pytest.raises(ValueError, match="median_us"):
        store.record_trial(**ids, shape_key=SHAPE_KEY, shape_json=SHAPE, kv_format="bf16",
                           backend="t", source_hash="s", config={}, status="ok", stats=None)
    with pytest.raises(ValueError, match="unknown timing"):
        store.record_trial(**ids, shape_key=SHAPE_KEY, shape_json=SHAPE, kv_format="bf16",
                           backend="t", source_hash="s", config={}, status="ok",
                           stats={"median": 1.0})
    with pytest.raises(IntegrityError):  # foreign keys are enforced
        store.record_trial(device_id=999, software_id=ids["software_id"], shape_key=SHAPE_KEY,
                           shape_json=SHAPE, kv_format="bf16", backend="t", source_hash="s",
                           config={}, status="failed")
    assert store.trials() == []


def test_winner_is_fastest_current_ok_trial(store, ids):
    d, s = ids["device_id"], ids["software_id"]
    _record(store, ids, {"c": 1}, median=10.0)
    _record(store, ids, {"c": 2}, status="wrong", max_abs_err=3.0)
    _record(store, ids, {"c": 3}, status="failed", error="boom")
    _record(store, ids, {"c": 4}, status="timeout")
    _record(store, ids, {"c": 5}, median=1.0, source="stale")
    _record(store, ids, {"c": 6}, median=2.0, backend="flashinfer", source="fi1")
    fast = _record(store, ids, {"c": 7}, median=8.0)
    current = {"triton": "src1"}

    w = store.update_winner(d, s, SHAPE_KEY, current)
    assert (w.trial_id, w.backend, w.config, w.median_us) == (fast, "triton", {"c": 7}, 8.0)
    assert (w.device, w.software, w.shape_json, w.kv_format) == (GPU, STACK, SHAPE, "bf16")

    w2 = store.update_winner(d, s, SHAPE_KEY, {**current, "flashinfer": "fi1"})
    assert (w2.id, w2.backend, w2.source_hash, w2.median_us) == (w.id, "flashinfer", "fi1", 2.0)
    assert store.winners() == [w2]

    assert store.update_winner(d, s, SHAPE_KEY, {"triton": "src9"}) is None
    assert store.winners() == []


def test_winner_ties_go_to_the_earlier_trial(store, ids):
    first = _record(store, ids, {"c": 1}, median=5.0)
    _record(store, ids, {"c": 2}, median=5.0)
    w = store.update_winner(ids["device_id"], ids["software_id"], SHAPE_KEY, {"triton": "src1"})
    assert w.trial_id == first


def test_remeasure_keeps_the_better_timing_and_both_medians(store, ids):
    d, s = ids["device_id"], ids["software_id"]
    a = _record(store, ids, {"c": 1}, median=10.0)
    b = _record(store, ids, {"c": 2}, median=10.5)
    c = _record(store, ids, {"c": 3}, median=10.8)  # not a finalist
    at = store.record_remeasure({a: _stats(12.0), b: _stats(9.5)})
    rows = {t.id: t for t in store.trials()}
    # a: its first timing was the better one; b: the re-timing was.
    assert (rows[a].median_us, rows[a].mean_us, rows[a].first_median_us,
            rows[a].runoff_median_us, rows[a].remeasured_at) == (10.0, 10.5, 10.0, 12.0, at)
    assert (rows[b].median_us, rows[b].mean_us, rows[b].first_median_us,
            rows[b].runoff_median_us, rows[b].remeasured_at) == (9.5, 10.0, 10.5, 9.5, at)
    assert (rows[c].median_us, rows[c].first_median_us, rows[c].remeasured_at) == (10.8, None,
                                                                                 None)
    assert store.update_winner(d, s, SHAPE_KEY, {"triton": "src1"}).trial_id == b
    # A second re-timing keeps the very first median and the best timing so far.
    store.record_remeasure({a: _stats(9.0), b: _stats(9.8)})
    rows = {t.id: t for t in store.trials()}
    assert (rows[a].median_us, rows[a].first_median_us, rows[a].runoff_median_us) == (9.0, 10.0,
                                                                                        9.0)
    assert (rows[b].median_us, rows[b].first_median_us, rows[b].runoff_median_us) == (9.5, 10.5,
                                                                                        9.8)
    assert store.update_winner(d, s, SHAPE_KEY, {"triton": "src1"}).trial_id == a


def test_mark_wrong_keeps_the_first_median_and_takes_the_trial_out_of_the_running(store, ids):
    d, s = ids["device_id"], ids["software_id"]
    fast = _record(store, ids, {"c": 1}, median=9.0)
    slow = _record(store, ids, {"c": 2}, median=10.0)
    store.mark_wrong(fast, "wrong when built again", max_abs_err=2.0, mismatch_frac=0.5)
    t = {t.id: t for t in store.trials()}[fast]
    assert (t.status, t.median_us, t.first_median_us, t.max_abs_err) == ("wrong", None, 9.0, 2.0)
    assert store.update_winner(d, s, SHAPE_KEY, {"triton": "src1"}).trial_id == slow
    with pytest.raises(ValueError, match="not a stored 'ok' trial"):
        store.mark_wrong(fast, "again")


def test_remeasure_refuses_what_it_cannot_store(store, ids):
    ok = _record(store, ids, {"c": 1}, median=10.0)
    bad = _record(store, ids, {"c": 2}, status="wrong", max_abs_err=1.0)
    before = store.trials()
    with pytest.raises(ValueError, match="only those can be re-timed"):
        store.record_remeasure({ok: _stats(9.0), bad: _stats(8.0)})
    with pytest.raises(ValueError, match="only those can be re-timed"):
        store.record_remeasure({9999: _stats(8.0)})
    with pytest.raises(ValueError, match="needs finite stats"):
        store.record_remeasure({ok: {"median_us": 9.0}})
    assert store.trials() == before  # nothing half-written


def test_winners_filters_and_carries_fingerprints(store, ids):
    other_dev = DeviceFingerprint("amd", "MI355X", "gfx950", 256, 288 << 30)
    other_ids = {"device_id": store.device_id(other_dev), "software_id": ids["software_id"]}
    store.set_read_bandwidth(ids["device_id"], 4000.0)
    for i in (ids, other_ids):
        _record(store, i, {"c": 1})
        store.update_winner(i["device_id"], i["software_id"], SHAPE_KEY, {"triton": "src1"})
    assert len(store.winners()) == 2
    [w] = store.winners(device_hash=GPU.hash)
    assert w.device == GPU and w.device_read_bw_gbps == 4000.0
    assert w.software.as_dict()["torch"] == "2.9.0"
    assert [x.device for x in store.winners(device_hash=other_dev.hash,
                                            software_hash=STACK.hash,
                                            shape_key=SHAPE_KEY)] == [other_dev]
    assert store.winners(software_hash="0" * 16) == []
    assert store.winners(shape_key="nope") == []


def test_optuna_study_shares_the_database(url):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with TuningStore(url) as store:
        study = optuna.create_study(study_name="s1", storage=store.optuna_storage())
        study.add_trial(optuna.trial.create_trial(params={"x": 1.0}, values=[3.0],
                        distributions={"x": optuna.distributions.FloatDistribution(0, 2)}))
    with TuningStore(url) as store:
        ids = {"device_id": store.device_id(GPU), "software_id": store.software_id(STACK)}
        _record(store, ids, {"c": 1})
        loaded = optuna.load_study(study_name="s1", storage=store.optuna_storage())
        assert loaded.best_value == 3.0
    tables = _tables(url)
    assert {"studies", "trials", "alembic_version"} <= tables and OUR_TABLES <= tables


def test_store_opens_on_an_existing_optuna_db(tmp_path):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    optuna.create_study(study_name="first", storage=url)
    with TuningStore(url) as store:
        assert store.trials() == []
        assert [s.study_name for s in optuna.get_all_study_summaries(store.optuna_storage())] \
            == ["first"]


def test_foreign_sqlite_db_gets_our_tables_alongside(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('keep me')")
    conn.commit()
    conn.close()
    TuningStore(str(path)).close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT body FROM notes").fetchall() == [("keep me",)]
    conn.close()
    assert OUR_TABLES | {"notes"} == _tables(str(path))


def test_non_sqlite_file_is_refused_untouched(tmp_path):
    path = tmp_path / "x.db"
    payload = b"these are my notes, not a database\n" * 100
    path.write_bytes(payload)
    with pytest.raises(DBError, match="not a SQLite database.*left untouched"):
        TuningStore(str(path))
    assert path.read_bytes() == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.db"]


def test_directory_path_is_refused(tmp_path):
    with pytest.raises(DBError, match="is a directory"):
        TuningStore(str(tmp_path))
    with pytest.raises(DBError, match="is a directory"):
        TuningStore(f"sqlite:///{tmp_path}")


def test_path_below_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DBError, match="not an existing directory"):
        TuningStore(str(blocker / "tuning.db"))
    assert blocker.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read a mode-000 file")
def test_unreadable_file_is_refused(tmp_path):
    path = tmp_path / "locked.db"
    path.write_bytes(b"")
    path.chmod(0)
    with pytest.raises(DBError, match="cannot read"):
        TuningStore(str(path))


def test_database_from_a_newer_version_is_refused(url):
    TuningStore(url).close()
    engine = create_engine(resolve_url(url))
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(DBError, match="newer mla-tune"):
        TuningStore(url)


def test_url_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    assert resolve_url().render_as_string() == "sqlite:///tuning.db"
    monkeypatch.setenv("MLA_TUNE_DB", str(tmp_path / "env.db"))
    assert resolve_url().database == str(tmp_path / "env.db")
    assert resolve_url("rel/path.db").database == "rel/path.db"
    assert resolve_url("postgresql://u:p@h/db").drivername == "postgresql+psycopg"
    with pytest.raises(DBError, match="unsupported database"):
        resolve_url("mysql://u:p@h/db")


def _open_and_record(url):
    with TuningStore(url) as s:
        d = s.device_id(DeviceFingerprint("cpu", "c", "x86_64", 8, 1 << 30))
        sw = s.software_id(SoftwareFingerprint((("python", "3"),)))
        return s.record_trial(device_id=d, software_id=sw, shape_key="k", shape_json={},
                              kv_format="bf16", backend="b", source_hash="h",
                              config={"c": 1}, status="ok", stats={"median_us": 1.0})


def _assert_one_trial(url):
    with TuningStore(url) as store:
        assert len(store.trials()) == 1 and len(store.devices()) == 1


def test_concurrent_first_open_threads(url):
    start = threading.Barrier(4)

    def worker():
        start.wait()
        return _open_and_record(url)

    with ThreadPoolExecutor(4) as pool:
        ids = [f.result() for f in [pool.submit(worker) for _ in range(4)]]
    assert len(set(ids)) == 1
    _assert_one_trial(url)


_WORKER = """
import sys, time
from pathlib import Path
from tests.db.test_store import _open_and_record
print("ready", flush=True)
while not Path(sys.argv[2]).exists():  # start line: both open the fresh DB at once
    time.sleep(0.002)
print(_open_and_record(sys.argv[1]))
"""


def test_concurrent_first_open_processes(sqlite_url, tmp_path):
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, sqlite_url, str(go)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    go.touch()
    results = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert {out.strip() for out, _ in results} == {"1"}
    _assert_one_trial(sqlite_url)


def test_delete_sources_keeps_what_winners_name_and_other_sources(store, ids):
    from mla_tune.db import TrialGroup

    for i in range(3):
        _record(store, ids, {"i": i}, median=5.0 + i, source="old")
        _record(store, ids, {"i": i}, median=9.0 + i, source="new")
    store.enqueue(TrialGroup(ids["device_id"], ids["software_id"], SHAPE_KEY, "triton", "old"),
                  [{"i": 7}])
    win = store.update_winner(ids["device_id"], ids["software_id"], SHAPE_KEY,
                              {"triton": "old"})
    by_source = {r.source_hash: r for r in store.sources()}
    assert {h: (r.trials, r.named_by_winners) for h, r in by_source.items()} == {
        "old": (3, 1), "new": (3, 0)}
    assert by_source["new"].newest_trial_id > by_source["old"].newest_trial_id

    gone = store.delete_sources([("triton", "old")])
    assert (gone.trials, gone.claims, gone.kept_for_winners) == (2, 1, 1)
    left = store.trials()
    assert sorted((t.source_hash, t.config["i"]) for t in left) == [
        ("new", 0), ("new", 1), ("new", 2), ("old", 0)]
    assert [w.trial_id for w in store.winners()] == [win.trial_id]
    store.compact()  # VACUUM on SQLite, nothing on PostgreSQL; the data is unchanged
    assert len(store.trials()) == 4


def test_compact_returns_deleted_space_to_the_file(tmp_path):
    path = tmp_path / "big.db"
    with TuningStore(str(path)) as store:
        ids = {"device_id": store.device_id(GPU), "software_id": store.software_id(STACK)}
        for i in range(400):
            _record(store, ids, {"i": i, "pad": "x" * 400}, source="old")
        _record(store, ids, {"i": 0}, source="new")
        before = path.stat().st_size
        store.delete_sources([("triton", "old")])
        assert path.stat().st_size == before  # SQLite keeps the freed pages...
        store.compact()
        assert path.stat().st_size < before / 2  # ...until VACUUM


def test_prune_writes_are_refused_read_only(sqlite_url):
    TuningStore(sqlite_url).close()
    with TuningStore(sqlite_url, read_only=True) as ro:
        with pytest.raises(DBError, match="read-only"):
            ro.delete_sources([("triton", "old")])
        with pytest.raises(DBError, match="read-only"):
            ro.compact()


def test_rename_source_moves_trials_claims_and_winners_but_never_onto_a_taken_key(store, ids):
    from mla_tune.db import TrialGroup

    for i in range(3):
        _record(store, ids, {"i": i}, median=5.0 + i, source="bytes")
    _record(store, ids, {"i": 2}, median=1.0, source="code")  # the new hash measured i=2
    _record(store, ids, {"i": 0}, median=4.0, backend="flashinfer", source="bytes")
    store.enqueue(TrialGroup(ids["device_id"], ids["software_id"], SHAPE_KEY, "triton",
                             "bytes"), [{"i": 7}])
    store.update_winner(ids["device_id"], ids["software_id"], SHAPE_KEY, {"triton": "bytes"})

    done = store.rename_source("triton", "bytes", "code")
    assert (done.trials, done.winners, done.claims, done.left) == (2, 1, 1, 1)
    assert sorted((t.backend, t.source_hash, t.config["i"]) for t in store.trials()) == [
        ("flashinfer", "bytes", 0), ("triton", "bytes", 2), ("triton", "code", 0),
        ("triton", "code", 1), ("triton", "code", 2)]
    (winner,) = store.winners()
    assert (winner.source_hash, winner.config) == ("code", {"i": 0})
    group = TrialGroup(ids["device_id"], ids["software_id"], SHAPE_KEY, "triton", "code")
    assert [c.config for c in store.claims(group)] == [{"i": 7}]
    again = store.rename_source("triton", "bytes", "code")
    assert (again.trials, again.winners, again.claims, again.left) == (0, 0, 0, 1)


def test_rename_source_is_refused_read_only(sqlite_url):
    TuningStore(sqlite_url).close()
    with TuningStore(sqlite_url, read_only=True) as ro:
        with pytest.raises(DBError, match="read-only"):
            ro.rename_source("triton", "a", "b")
