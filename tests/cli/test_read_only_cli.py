"""report, diff, export and the dispatcher only read the tuning DB: a missing DB is an error
(exit 2) and is not created, an existing one is neither migrated, locked nor changed."""

import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from mla_tune.cli.main import app
from mla_tune.machine.fingerprint import current_device, current_software
from mla_tune.problem.shapes import Shape
from mla_tune.runtime.dispatcher import Dispatcher
from tests.fixtures.sweep_db import SHAPES, swept_db
from tests.runtime.test_dispatcher import _record_winner

runner = CliRunner()


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    return tmp_path


@pytest.fixture
def db(tmp_path_factory):
    """A swept DB, closed, alone in its directory (no -wal/-shm next to it)."""
    path = tmp_path_factory.mktemp("ro") / "tuning.db"
    swept_db(path).close()
    assert sorted(p.name for p in path.parent.iterdir()) == ["tuning.db"]
    return path


@pytest.mark.parametrize("args", [
    ["report", "--db", "typo.db"],
    ["report"],
    ["report", "--format", "json", "--db", "sqlite:///typo.db"],
    ["export", "--out", "w.json", "--db", "typo.db"],
    ["diff", "deadbeef", "cafebabe"],
    ["diff", "deadbeef", "cafebabe", "--db", "typo.db"],
    ["diff", "sqlite:///a.db", "sqlite:///b.db"],
])
def test_missing_db_exits_2_and_creates_nothing(empty_cwd, args):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "no tuning DB file at" in r.output and "mla-tune sweep" in r.output
    assert list(empty_cwd.iterdir()) == []


def test_report_diff_export_in_a_read_only_directory_change_nothing(db, tmp_path):
    before = db.read_bytes()
    db.parent.chmod(0o555)
    try:
        for args in (["report", "--db", str(db), "--format", "json"],
                     ["report", "--db", str(db)],
                     ["diff", str(db), f"sqlite:///{db}"],
                     ["export", "--db", str(db), "--out", str(tmp_path / "w.json")]):
            r = runner.invoke(app, args, env={"COLUMNS": "250"})
            assert r.exit_code == 0, (args, r.output)
            assert sorted(p.name for p in db.parent.iterdir()) == ["tuning.db"], args
    finally:
        db.parent.chmod(0o755)
    assert db.read_bytes() == before
    assert '"shape_key"' in (tmp_path / "w.json").read_text()


def test_report_refuses_an_older_schema_without_upgrading_it(db):
    engine = create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE mt_claims"))
        conn.execute(text("UPDATE mt_alembic_version SET version_num = '0001'"))
    engine.dispose()
    before = db.read_bytes()
    r = runner.invoke(app, ["report", "--db", str(db)])
    assert r.exit_code == 2 and "older than" in r.output and "mla-tune sweep" in r.output
    assert db.read_bytes() == before


def test_dispatcher_loads_while_a_sweep_holds_the_write_lock(tmp_path):
    path = tmp_path / "tuning.db"
    shape = Shape.uniform(4, 256)
    from mla_tune.db import TuningStore

    with TuningStore(str(path)) as store:
        _record_winner(store, current_device("cpu"), current_software(), shape)
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE mt_winners SET median_us = median_us")
        t0 = time.monotonic()
        d = Dispatcher.from_db(str(path), "cpu")
        elapsed = time.monotonic() - t0
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert d.loaded == 1 and d.decide(shape).reason == "exact"
    assert elapsed < 2.0


def test_dispatcher_warns_on_another_schema_and_falls_back(db, caplog):
    engine = create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        conn.execute(text("UPDATE mt_alembic_version SET version_num = '9999'"))
    engine.dispose()
    before = db.read_bytes()
    d = Dispatcher.from_db(str(db), "cpu")
    assert d.loaded == 0
    assert any("unusable" in r.message and "newer mla-tune" in r.message
               for r in caplog.records)
    assert d.decide(SHAPES[0]).reason == "heuristic"
    assert db.read_bytes() == before and sorted(p.name for p in Path(db).parent.iterdir()) \
        == ["tuning.db"]
