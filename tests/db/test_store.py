"""What is particular to the SQLAlchemy store: migrations, files, URLs, first opens, and
Optuna's tables alongside ours (what every store promises: test_storage_contract.py)."""

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

from mla_tune.db import DBError, TrialGroup, TrialResult, TuningStore, resolve_url
from mla_tune.db.models import VERSION_TABLE, Base, is_ours
from mla_tune.machine.fingerprint import DeviceFingerprint, SoftwareFingerprint
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

REPO = Path(__file__).resolve().parents[2]
OUR_TABLES = {"mt_devices", "mt_software", "mt_trials", "mt_winners", "mt_claims",
              VERSION_TABLE}


def _record(store, ids, config, source="src1"):
    return store.record_trial(TrialGroup(**ids, shape_key=SHAPE_KEY, backend="triton",
                                         source_hash=source),
                              TrialResult(SHAPE, "bf16", config, "ok", {"median_us": 10.0}))


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
        return s.record_trial(TrialGroup(d, sw, "k", "b", "h"),
                              TrialResult({}, "bf16", {"c": 1}, "ok", {"median_us": 1.0}))


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
        assert path.stat().st_size < before / 2  # ...until VACUUM, checkpointed
        wal = Path(f"{path}-wal")
        assert not wal.exists() or wal.stat().st_size == 0
