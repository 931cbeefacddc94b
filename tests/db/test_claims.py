"""The claims queue in SQL: its table's migration, and that no row is left behind when a
trial is stored while candidates are queued (the queue's promises:
test_storage_contract.py)."""

import threading

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, inspect, text

from mla_tune.db import TrialGroup, TrialResult, TuningStore, resolve_url
from mla_tune.db.engine import MIGRATIONS_DIR
from mla_tune.tuning.space import config_key
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

CONFIGS = [{"c": i} for i in range(4)]


def _group(ids):
    return TrialGroup(ids["device_id"], ids["software_id"], SHAPE_KEY, "triton", "5c1a")


def _store_trial(store, group, config):
    return store.record_trial(group, TrialResult(SHAPE, "bf16", config, "failed",
                                                 error="boom"))


def test_a_0001_database_gains_the_claims_table(sqlite_url):
    engine = create_engine(sqlite_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    assert "mt_claims" not in inspect(engine).get_table_names()
    with TuningStore(sqlite_url) as s:
        ids = {"device_id": s.device_id(GPU), "software_id": s.software_id(STACK)}
        s.enqueue(_group(ids), CONFIGS[:1])
        assert len(s.claims(_group(ids))) == 1
    engine.dispose()


def _claim_rows(url):
    """Every row of the claims table, measured or not (`claims()` hides measured ones)."""
    engine = create_engine(resolve_url(url))
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT config_key, state FROM mt_claims")).all()
    finally:
        engine.dispose()


def test_claiming_a_measured_config_queues_nothing(url, store, ids):
    g = _group(ids)
    _store_trial(store, g, {"c": 7})
    assert store.claim(g, "a", stale_after_s=60, config={"c": 7}) is None
    assert _claim_rows(url) == []


def test_a_trial_stored_while_candidates_are_queued_leaves_no_orphan_claim(url, store, ids):
    """Another sweep stores a candidate's trial between `enqueue` reading what is measured
    and queueing the rest: the candidate ends up stored and not queued."""
    g = _group(ids)
    other = TuningStore(url)
    fired = []

    def store_elsewhere(conn, cursor, statement, params, context, many):
        if statement.startswith("INSERT INTO mt_claims") and not fired:
            fired.append(threading.Thread(target=_store_trial, args=(other, g, CONFIGS[0])))
            fired[0].start()
            fired[0].join(timeout=1)  # with the group locked it waits for this transaction

    event.listen(Engine, "before_cursor_execute", store_elsewhere)
    try:
        store.enqueue(g, CONFIGS)
    finally:
        event.remove(Engine, "before_cursor_execute", store_elsewhere)
    fired[0].join()
    other.close()
    assert [t.config for t in store.trials()] == [CONFIGS[0]]
    assert sorted(k for k, _ in _claim_rows(url)) == sorted(
        config_key(c) for c in CONFIGS[1:])
