"""A damaged DB file is refused before anything is written to it, and a full disk during a
write is a DBError that says so, with everything stored before it kept."""

import sqlite3

import pytest
from sqlalchemy import make_url

from mla_tune.db import DBError, TrialGroup, TrialResult, TuningStore
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK
from tests.db.faults import (
    PAGE,
    disk_full_after,
    fill,
    integrity,
    overwrite_header,
    overwrite_pages,
    truncate,
)


def _record(store, group, i):
    return store.record_trial(group, TrialResult(SHAPE, "bf16", {"i": i, "pad": "x" * 200},
                                                 "ok", {"median_us": 10.0 + i}))


@pytest.fixture
def filled(tmp_path):
    path = tmp_path / "tuning.db"
    fill(path)
    assert path.stat().st_size > 20 * PAGE and integrity(path) == ["ok"]
    return path


@pytest.mark.parametrize("damage", [
    truncate,
    lambda p: overwrite_pages(p, first=p.stat().st_size // PAGE // 2),
    lambda p: overwrite_pages(p, first=2, count=1),
    overwrite_header,
], ids=["truncated", "garbage-pages", "garbage-root-page", "garbage-header"])
def test_damaged_file_is_refused_for_writing_untouched(filled, damage):
    damage(filled)
    payload = filled.read_bytes()
    with pytest.raises(DBError, match="is damaged") as err:
        TuningStore(str(filled))
    assert ".recover" in str(err.value) and "--db" in str(err.value)
    assert filled.read_bytes() == payload


def test_disk_full_is_a_dberror_and_keeps_what_was_stored(tmp_path):
    path = tmp_path / "tuning.db"
    TuningStore(str(path)).close()
    stored = []
    with disk_full_after(pages=3), TuningStore(str(path)) as store:
        ids = {"device_id": store.device_id(GPU), "software_id": store.software_id(STACK)}
        group = TrialGroup(**ids, shape_key=SHAPE_KEY, backend="triton", source_hash="5c0a")
        with pytest.raises(DBError, match="is full") as err:
            for i in range(1000):
                store.enqueue(group, [{"i": i, "pad": "x" * 200}])
                stored.append(_record(store, group, i))
    assert "Nothing stored was lost" in str(err.value) and "run the same command" in str(err.value)
    assert isinstance(err.value.__cause__.orig, sqlite3.OperationalError)
    assert 0 < len(stored) < 1000 and integrity(path) == ["ok"]
    with TuningStore(str(path)) as store:
        assert [t.id for t in store.trials()] == stored
        # The failed candidate's claim was rolled back with its trial, or is still queued.
        assert len(store.claims(group)) <= 1


def test_a_read_only_postgresql_server_is_a_dberror_that_says_so(pg_url):
    """A hot standby (every transaction read-only): the failed write is named, not dumped."""
    TuningStore(pg_url).close()
    url = make_url(pg_url)
    standby = url.update_query_dict(
        {"options": url.query["options"] + " -cdefault_transaction_read_only=on"})
    with TuningStore(standby.render_as_string(hide_password=False)) as store:
        with pytest.raises(DBError, match="cannot be written") as err:
            store.device_id(GPU)
    assert "read-only" in str(err.value)
