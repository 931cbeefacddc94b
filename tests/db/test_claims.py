"""The claims queue: each candidate is taken once, stale or dead holders' candidates are
taken over, and storing a trial releases its claim in the same transaction."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, inspect, text

from mla_tune.db import TrialGroup, TuningStore, resolve_url
from mla_tune.db.store import MIGRATIONS_DIR
from mla_tune.space import config_key
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

CONFIGS = [{"c": i} for i in range(4)]


def _group(ids, backend="triton"):
    return TrialGroup(ids["device_id"], ids["software_id"], SHAPE_KEY, backend, "src1")


def _store_trial(store, group, config):
    return store.record_trial(device_id=group.device_id, software_id=group.software_id,
                              shape_key=group.shape_key, shape_json=SHAPE, kv_format="bf16",
                              backend=group.backend, source_hash=group.source_hash,
                              config=config, status="failed", error="boom")


def test_each_candidate_is_claimed_once_in_order(store, ids):
    g = _group(ids)
    store.enqueue(g, CONFIGS)
    store.enqueue(g, CONFIGS)  # idempotent
    taken = [store.claim(g, owner, stale_after_s=60) for owner in ("a", "b", "a", "b", "a")]
    assert taken == [*CONFIGS, None]
    assert [c.state for c in store.claims(g)] == ["running"] * 4
    assert store.heartbeat("a") == 2 and store.heartbeat("nobody") == 0
    _store_trial(store, g, CONFIGS[0])
    assert [c.config for c in store.claims(g)] == CONFIGS[1:]
    assert store.release("a") == 1  # CONFIGS[2]; CONFIGS[0] is stored
    assert store.claim(g, "c", stale_after_s=60) == CONFIGS[2]
    store.enqueue(g, CONFIGS[:1])  # a stored candidate is never queued again
    assert store.claim(g, "c", stale_after_s=60) is None
    other = _group(ids, backend="torch")
    assert store.claims(other) == [] and store.claim(other, "a", stale_after_s=60) is None


def test_stale_and_dead_holders_are_taken_over(store, ids):
    g = _group(ids)
    store.enqueue(g, CONFIGS[:2])
    assert store.claim(g, "a", stale_after_s=60) == CONFIGS[0]
    assert store.claim(g, "b", stale_after_s=60) == CONFIGS[1]
    assert store.claim(g, "c", stale_after_s=60) is None
    assert store.claim(g, "c", stale_after_s=60, dead_owners={"a"}) == CONFIGS[0]
    time.sleep(0.6)
    store.heartbeat("c")
    assert store.claim(g, "d", stale_after_s=0.5) == CONFIGS[1]  # b went stale, c did not
    rows = {c.config["c"]: c for c in store.claims(g)}
    assert rows[0].claimed_by == "c" and rows[1].claimed_by == "d"
    assert all(0 <= c.heartbeat_age_s < 5 for c in rows.values())


def test_claiming_a_given_config_queues_it_once(store, ids):
    g = _group(ids)
    assert store.claim(g, "a", stale_after_s=60, config={"c": 7}) == {"c": 7}
    assert store.claim(g, "b", stale_after_s=60, config={"c": 7}) is None
    _store_trial(store, g, {"c": 7})
    assert store.claim(g, "b", stale_after_s=60, config={"c": 7}) is None
    assert store.claims(g) == []


def test_concurrent_claimers_never_share_a_candidate(url):
    with TuningStore(url) as setup:
        ids = {"device_id": setup.device_id(GPU), "software_id": setup.software_id(STACK)}
        g = _group(ids)
        configs = [{"c": i} for i in range(40)]
        setup.enqueue(g, configs)

    def work(owner):
        with TuningStore(url) as s:
            got = []
            while (config := s.claim(g, owner, stale_after_s=60)) is not None:
                got.append(config["c"])
                _store_trial(s, g, config)
            return got

    with ThreadPoolExecutor(4) as pool:
        taken = list(pool.map(work, ["w0", "w1", "w2", "w3"]))
    flat = sorted(c for got in taken for c in got)
    assert flat == list(range(40))
    with TuningStore(url) as s:
        assert len(s.trials()) == 40 and s.claims(g) == []


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


def test_a_budget_counts_what_every_sweep_stored_or_holds(store, ids):
    g = _group(ids)
    store.enqueue(g, [{"c": i} for i in range(6)])
    assert store.claim(g, "a", stale_after_s=60, budget=3) == {"c": 0}
    assert store.claim(g, "b", stale_after_s=60, budget=3) == {"c": 1}
    _store_trial(store, g, {"c": 0})
    assert store.spent(g, stale_after_s=60) == 2
    assert store.claim(g, "b", stale_after_s=60, config={"c": 9}, budget=3) == {"c": 9}
    assert store.spent(g, stale_after_s=60) == 3
    assert store.claim(g, "a", stale_after_s=60, budget=3) is None
    assert store.claim(g, "a", stale_after_s=60, config={"c": 8}, budget=3) is None
    # A dead holder's candidate no longer counts, and is taken over within the budget.
    assert store.spent(g, stale_after_s=60, dead_owners={"b"}) == 1
    taken = store.claim(g, "a", stale_after_s=60, dead_owners={"b"}, budget=3)
    assert taken == {"c": 1}
    assert store.claim(g, "a", stale_after_s=60, dead_owners={"b"}, budget=3) == {"c": 2}
    assert store.claim(g, "a", stale_after_s=60, dead_owners={"b"}, budget=3) is None
