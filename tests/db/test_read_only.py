"""`TuningStore(url, read_only=True)`: what reports, diff, export and the dispatcher open.
It never creates, migrates, locks or writes the DB (that every write is refused:
test_storage_contract.py)."""

import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from mla_tune.db import DBError, TrialGroup, TrialResult, TuningStore
from mla_tune.results.selection import update_winner
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

SOURCE = "abc123"


def _fill(url: str) -> None:
    """A DB with one device, stack, 'ok' trial and winner, closed."""
    with TuningStore(url) as s:
        dev, sw = s.device_id(GPU), s.software_id(STACK)
        s.record_trial(TrialGroup(dev, sw, SHAPE_KEY, "triton", SOURCE),
                       TrialResult(SHAPE, "bf16", {"num_splits": 4}, "ok", {"median_us": 12.5}))
        assert update_winner(s, dev, sw, SHAPE_KEY, {"triton": SOURCE}) is not None


def _set_revision(url: str, rev: str, undo: tuple[str, ...] = ()) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement in undo:
            conn.execute(text(statement))
        conn.execute(text("UPDATE mt_alembic_version SET version_num = :r"), {"r": rev})
    engine.dispose()


def _sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def test_missing_file_raises_and_creates_nothing(tmp_path):
    for where in (str(tmp_path / "typo.db"), f"sqlite:///{tmp_path / 'typo.db'}"):
        with pytest.raises(DBError, match=r"no tuning DB file at .*typo\.db.*mla-tune sweep"):
            TuningStore(where, read_only=True)
    assert list(tmp_path.iterdir()) == []


def test_older_revision_is_refused_with_how_to_upgrade(url):
    _fill(url)
    _set_revision(url, "0002", undo=(  # what revision 0003 added
        "ALTER TABLE mt_trials DROP COLUMN first_median_us",
        "ALTER TABLE mt_trials DROP COLUMN runoff_median_us",
        "ALTER TABLE mt_trials DROP COLUMN remeasured_at"))
    with pytest.raises(DBError, match=r"revision 0002, older than .*mla-tune sweep"):
        TuningStore(url, read_only=True)
    TuningStore(url).close()  # a read-write open (what a sweep does) upgrades it ...
    with TuningStore(url, read_only=True) as ro:  # ... and then it reads, trials intact
        assert len(ro.winners()) == 1
        (t,) = ro.trials()
        assert (t.median_us, t.first_median_us, t.remeasured_at) == (12.5, None, None)


def test_unknown_revision_is_refused_as_newer(url):
    _fill(url)
    _set_revision(url, "9999")
    with pytest.raises(DBError, match=r"revision 9999, .*newer mla-tune; upgrade mla-tune"):
        TuningStore(url, read_only=True)


def test_postgresql_read_only_never_migrates(pg_url):
    with pytest.raises(DBError, match="no mla-tune tables"):
        TuningStore(pg_url, read_only=True)
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        tables = conn.execute(text("SELECT count(*) FROM information_schema.tables "
                                   "WHERE table_schema = current_schema()")).scalar_one()
    engine.dispose()
    assert tables == 0


@pytest.mark.parametrize("content", [b"", None])
def test_sqlite_file_without_our_tables_is_refused_untouched(tmp_path, content):
    path = tmp_path / "other.db"
    if content is None:  # a SQLite DB of something else
        with closing(sqlite3.connect(path)) as conn:
            conn.execute("CREATE TABLE t (x)")
            conn.commit()
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    with pytest.raises(DBError, match="no mla-tune tables .*mla-tune sweep"):
        TuningStore(str(path), read_only=True)
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_sqlite_in_a_read_only_directory_leaves_no_file_behind(sqlite_url):
    """Read-only directory: works, and no -wal/-shm is created, the DB's bytes are unchanged
    (root ignores the mode bits, so the no-files assertions are what proves it there)."""
    _fill(sqlite_url)
    path = _sqlite_path(sqlite_url)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tuning.db"]
    before = path.read_bytes()
    path.parent.chmod(0o555)
    try:
        with TuningStore(sqlite_url, read_only=True) as ro:
            assert [w.shape_key for w in ro.winners()] == [SHAPE_KEY]
            assert len(ro.trials()) == 1
            assert sorted(p.name for p in path.parent.iterdir()) == ["tuning.db"]
    finally:
        path.parent.chmod(0o755)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tuning.db"]
    assert path.read_bytes() == before


def test_sqlite_reader_is_not_blocked_by_a_writer_and_sees_later_writes(sqlite_url):
    _fill(sqlite_url)
    path = _sqlite_path(sqlite_url)
    ro = TuningStore(sqlite_url, read_only=True)  # opened while nobody else has the DB open
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("PRAGMA journal_mode = WAL")
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE mt_winners SET median_us = 1.0")
        t0 = time.monotonic()
        with TuningStore(sqlite_url, read_only=True) as other:
            assert [w.median_us for w in other.winners()] == [12.5]  # the last commit
        assert [w.median_us for w in ro.winners()] == [12.5]
        assert time.monotonic() - t0 < 2.0
        writer.execute("COMMIT")
        assert [w.median_us for w in ro.winners()] == [1.0]
    finally:
        writer.close()  # the last connection: checkpoints into the main file, drops -wal
    assert not Path(f"{path}-wal").exists()
    with TuningStore(sqlite_url) as rw:  # a later write, after which no -wal is left either
        rw.set_read_bandwidth(rw.devices()[0].id, 4000.0)
    assert [d.read_bw_gbps for d in ro.devices()] == [4000.0]
    ro.close()


def test_sqlite_memory_db_is_refused_read_only():
    with pytest.raises(DBError, match="in-memory"):
        TuningStore("sqlite://", read_only=True)


def test_unreadable_file_is_a_db_error(sqlite_url):
    if os.geteuid() == 0:
        pytest.skip("root can read a mode-000 file")
    _fill(sqlite_url)
    path = _sqlite_path(sqlite_url)
    path.chmod(0)
    try:
        with pytest.raises(DBError, match="cannot read"):
            TuningStore(sqlite_url, read_only=True)
    finally:
        path.chmod(0o644)


def test_lock_free_read_is_retried_when_the_file_changes_meanwhile(sqlite_url, monkeypatch):
    import mla_tune.db.engine as engine_mod

    _fill(sqlite_url)
    real, calls = engine_mod.clean_state, []

    def changing(path):  # the check after the first read sees the file changed
        calls.append(path)
        state = real(path)
        return (state[0], state[1] + 1, state[2]) if len(calls) == 2 and state else state

    with TuningStore(sqlite_url, read_only=True) as ro:
        monkeypatch.setattr(engine_mod, "clean_state", changing)
        assert [w.shape_key for w in ro.winners()] == [SHAPE_KEY]
    assert len(calls) == 4  # open + check, then the retry's open + check
