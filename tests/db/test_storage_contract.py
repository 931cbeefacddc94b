"""The storage contract (`BaseTuningStore`), checked against every database a store runs on:
SQLite and PostgreSQL (when $MLA_TUNE_TEST_PG_URL names a server). Each test is one promise
of the contract's docstring; implementation details live in the other tests/db files."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from mla_tune.db import (
    BaseTuningStore,
    DBError,
    DeletedRows,
    TrialGroup,
    TrialResult,
    TuningStore,
    resolve_url,
)
from mla_tune.machine.fingerprint import DeviceFingerprint
from mla_tune.results.selection import fastest_correct, update_winner
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

CONFIGS = [{"c": i} for i in range(4)]


def _stats(median):
    return {"median_us": median, "mean_us": median + 0.5, "std_us": 0.1,
            "min_us": median - 0.2, "max_us": median + 1.0, "n": 50}


def _group(ids, backend="triton", source="5c1a"):
    return TrialGroup(ids["device_id"], ids["software_id"], SHAPE_KEY, backend, source)


def _result(config, status="ok", median=10.0, **kw):
    return TrialResult(shape_json=SHAPE, kv_format="bf16", config=config, status=status,
                       stats=_stats(median) if status == "ok" else None, **kw)


def _record(store, ids, config, status="ok", median=10.0, backend="triton", source="5c1a",
            **kw):
    return store.record_trial(_group(ids, backend, source), _result(config, status, median,
                                                                     **kw))


def _winner(store, ids, current):
    return update_winner(store, ids["device_id"], ids["software_id"], SHAPE_KEY, current)


def _sql(url, statement, **params):
    """Run one statement on the database directly (to age or damage rows)."""
    engine = create_engine(resolve_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text(statement), params)
    finally:
        engine.dispose()


def test_the_store_is_an_implementation_of_the_contract(store):
    assert isinstance(store, BaseTuningStore)
    assert not TuningStore.__abstractmethods__


# Atomicity and claims


def test_each_candidate_is_claimed_once_in_order_and_storing_drops_its_claim(store, ids):
    g = _group(ids)
    store.enqueue(g, CONFIGS)
    store.enqueue(g, CONFIGS)  # idempotent
    taken = [store.claim(g, owner, stale_after_s=60) for owner in ("a", "b", "a", "b", "a")]
    assert taken == [*CONFIGS, None]
    assert [c.state for c in store.claims(g)] == ["running"] * 4
    assert store.heartbeat("a") == 2 and store.heartbeat("nobody") == 0
    store.record_trial(g, _result(CONFIGS[0], "failed", error="boom"))
    assert [c.config for c in store.claims(g)] == CONFIGS[1:]
    assert store.release("a") == 1  # CONFIGS[2]; CONFIGS[0] is stored
    assert store.claim(g, "c", stale_after_s=60) == CONFIGS[2]
    store.enqueue(g, CONFIGS[:1])  # a stored candidate is never queued again
    assert store.claim(g, "c", stale_after_s=60) is None
    other = _group(ids, backend="torch")
    assert store.claims(other) == [] and store.claim(other, "a", stale_after_s=60) is None


def test_concurrent_claimers_never_share_a_candidate(url):
    with TuningStore(url) as setup:
        ids = {"device_id": setup.device_id(GPU), "software_id": setup.software_id(STACK)}
        g = _group(ids)
        configs = [{"c": i} for i in range(40)]
        setup.enqueue(g, configs)
    start = threading.Barrier(4)

    def work(owner):
        with TuningStore(url) as s:
            start.wait()
            got = []
            while (config := s.claim(g, owner, stale_after_s=60)) is not None:
                got.append(config["c"])
                s.record_trial(g, _result(config, "failed", error="boom"))
            return got

    with ThreadPoolExecutor(4) as pool:
        taken = list(pool.map(work, ["w0", "w1", "w2", "w3"]))
    assert sorted(c for got in taken for c in got) == list(range(40))
    with TuningStore(url) as s:
        assert len(s.trials()) == 40 and s.claims(g) == []


def test_a_stale_or_dead_owners_claim_is_taken_over_and_stored_once(url, store, ids):
    g = _group(ids)
    store.enqueue(g, CONFIGS[:2])
    assert store.claim(g, "a", stale_after_s=60) == CONFIGS[0]
    assert store.claim(g, "b", stale_after_s=60) == CONFIGS[1]
    assert store.claim(g, "c", stale_after_s=60) is None  # both owners are alive
    assert store.claim(g, "c", stale_after_s=60, dead_owners={"a"}) == CONFIGS[0]
    # b stops heartbeating: an hour later (by the database's clock) its claim is stale.
    _sql(url, "UPDATE mt_claims SET heartbeat_at = heartbeat_at - 3600 WHERE claimed_by = 'b'")
    store.heartbeat("c")
    assert store.claim(g, "d", stale_after_s=60) == CONFIGS[1]
    rows = {c.config["c"]: c for c in store.claims(g)}
    assert (rows[0].claimed_by, rows[1].claimed_by) == ("c", "d")
    assert all(0 <= c.heartbeat_age_s < 60 for c in rows.values())
    # The former owner still stores its result; the new owner's is then a duplicate.
    first = store.record_trial(g, _result(CONFIGS[1], median=7.0, worker="b"))
    assert store.record_trial(g, _result(CONFIGS[1], median=9.0, worker="d")) == first
    assert [(t.config, t.worker) for t in store.trials()] == [(CONFIGS[1], "b")]
    assert [c.config for c in store.claims(g)] == [CONFIGS[0]]


def test_claiming_a_given_config_queues_it_once(store, ids):
    g = _group(ids)
    assert store.claim(g, "a", stale_after_s=60, config={"c": 7}) == {"c": 7}
    assert store.claim(g, "b", stale_after_s=60, config={"c": 7}) is None
    store.record_trial(g, _result({"c": 7}, "failed"))
    assert store.claim(g, "b", stale_after_s=60, config={"c": 7}) is None
    assert store.claims(g) == []


def test_a_budget_counts_what_every_owner_stored_or_holds(store, ids):
    g = _group(ids)
    store.enqueue(g, [{"c": i} for i in range(6)])
    assert store.claim(g, "a", stale_after_s=60, budget=3) == {"c": 0}
    assert store.claim(g, "b", stale_after_s=60, budget=3) == {"c": 1}
    store.record_trial(g, _result({"c": 0}, "failed"))
    assert store.spent(g, stale_after_s=60) == 2
    assert store.claim(g, "b", stale_after_s=60, config={"c": 9}, budget=3) == {"c": 9}
    assert store.spent(g, stale_after_s=60) == 3
    assert store.claim(g, "a", stale_after_s=60, budget=3) is None
    assert store.claim(g, "a", stale_after_s=60, config={"c": 8}, budget=3) is None
    # A dead owner's candidate no longer counts, and is taken over within the budget.
    assert store.spent(g, stale_after_s=60, dead_owners={"b"}) == 1
    assert store.claim(g, "a", stale_after_s=60, dead_owners={"b"}, budget=3) == {"c": 1}
    assert store.claim(g, "a", stale_after_s=60, dead_owners={"b"}, budget=3) == {"c": 2}
    assert store.claim(g, "a", stale_after_s=60, dead_owners={"b"}, budget=3) is None


def test_choosing_and_storing_a_winner_is_one_step_per_shape(url, store, ids):
    """While one store chooses a shape's winner, another's choice for the shape waits until
    the first is stored, so the later choice is the one that stands."""
    _record(store, ids, {"c": 1}, median=5.0)
    other = TuningStore(url)
    inside, other_done, seen = threading.Event(), threading.Event(), []

    def slow_choice(candidates):
        inside.set()
        seen.append(other_done.wait(timeout=0.5))  # the other must not finish meanwhile
        return fastest_correct(candidates)

    def race():
        inside.wait()
        other.replace_winner(ids["device_id"], ids["software_id"], SHAPE_KEY,
                             {"triton": "5c1a"}, lambda candidates: seen.append(
                                 len(candidates)))  # returns None: removes the winner
        other_done.set()

    racer = threading.Thread(target=race)
    racer.start()
    try:
        first = store.replace_winner(ids["device_id"], ids["software_id"], SHAPE_KEY,
                                     {"triton": "5c1a"}, slow_choice)
    finally:
        racer.join()
        other.close()
    assert first is not None and seen == [False, 1]
    assert store.winners() == []


def test_a_refused_write_stores_nothing(store, ids):
    ok = _record(store, ids, {"c": 1}, median=10.0)
    bad = _record(store, ids, {"c": 2}, status="wrong", max_abs_err=1.0)
    before = store.trials()
    with pytest.raises(ValueError, match="only those can be re-timed"):
        store.record_remeasure({ok: _stats(9.0), bad: _stats(8.0)})
    with pytest.raises(ValueError, match="only those can be re-timed"):
        store.record_remeasure({9999: _stats(8.0)})
    with pytest.raises(ValueError, match="needs finite stats"):
        store.record_remeasure({ok: {"median_us": 9.0}})
    with pytest.raises(ValueError, match="not one of the candidates"):
        store.replace_winner(ids["device_id"], ids["software_id"], SHAPE_KEY,
                             {"triton": "other"}, lambda _: before[0])
    with pytest.raises(ValueError, match="only failed, timeout or wrong"):
        store.delete_trials(_group(ids), ["ok"])
    assert store.trials() == before and store.winners() == []


# Results


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
    with pytest.raises(ValueError, match="positive"):
        store.set_read_bandwidth(d, float("nan"))


def test_trial_round_trip(store, ids):
    tid = _record(store, ids, {"BLOCK_N": 64, "num_warps": 4}, median=12.5, worker="h:gpu0",
                  max_abs_err=1e-3, mismatch_frac=0.0)
    _record(store, ids, {"BLOCK_N": 32, "num_warps": 4}, status="failed", error="OOM")
    [row] = store.trials(status="ok")
    assert row.id == tid
    assert row.config == {"BLOCK_N": 64, "num_warps": 4}
    assert row.config_key == '{"BLOCK_N":64,"num_warps":4}'
    assert row.shape_json == SHAPE and row.shape_key == SHAPE_KEY and row.kv_format == "bf16"
    assert (row.median_us, row.mean_us, row.std_us, row.min_us, row.max_us, row.n) == (
        12.5, 13.0, 0.1, 12.3, 13.5, 50)
    assert (row.max_abs_err, row.mismatch_frac, row.worker) == (1e-3, 0.0, "h:gpu0")
    assert row.created_at.tzinfo is not None
    measured = store.measured(_group(ids))
    assert set(measured) == {'{"BLOCK_N":32,"num_warps":4}', '{"BLOCK_N":64,"num_warps":4}'}
    assert measured['{"BLOCK_N":32,"num_warps":4}'].error == "OOM"
    assert store.measured(_group(ids, source="5c2a")) == {}
    assert len(store.trials(backend="triton", shape_key=SHAPE_KEY)) == 2
    assert store.trials(backend="flashinfer") == []


def test_a_duplicate_trial_keeps_the_first(store, ids):
    first = _record(store, ids, {"a": 1, "b": 2}, median=10.0)
    before = store.trials()
    assert _record(store, ids, {"b": 2, "a": 1}, status="failed", error="other") == first
    assert store.trials() == before


def test_a_result_no_trial_can_hold_is_refused(store, ids):
    with pytest.raises(ValueError, match="status"):
        _result({"a": 1}, status="great")
    with pytest.raises(ValueError, match="median_us"):
        TrialResult(SHAPE, "bf16", {}, "ok", stats=None)
    with pytest.raises(ValueError, match="median_us"):
        TrialResult(SHAPE, "bf16", {}, "ok", stats={"median_us": float("inf")})
    with pytest.raises(ValueError, match="unknown timing"):
        TrialResult(SHAPE, "bf16", {}, "ok", stats={"median": 1.0})
    with pytest.raises(IntegrityError):  # ids must name a device and a stack
        store.record_trial(TrialGroup(999, ids["software_id"], SHAPE_KEY, "t", "s"),
                           _result({}, "failed"))
    assert store.trials() == []


def test_the_winner_is_the_fastest_correct_trial_of_current_sources(store, ids):
    _record(store, ids, {"c": 1}, median=10.0)
    _record(store, ids, {"c": 2}, status="wrong", max_abs_err=3.0)
    _record(store, ids, {"c": 3}, status="failed", error="boom")
    _record(store, ids, {"c": 4}, status="timeout")
    _record(store, ids, {"c": 5}, median=1.0, source="stale")
    _record(store, ids, {"c": 6}, median=2.0, backend="flashinfer", source="f1")
    fast = _record(store, ids, {"c": 7}, median=8.0)
    current = {"triton": "5c1a"}

    w = _winner(store, ids, current)
    assert (w.trial_id, w.backend, w.config, w.median_us) == (fast, "triton", {"c": 7}, 8.0)
    assert (w.device, w.software, w.shape.to_json(), w.shape.kv_format.value) == (
        GPU, STACK, SHAPE, "bf16")
    w2 = _winner(store, ids, {**current, "flashinfer": "f1"})
    assert (w2.id, w2.backend, w2.source_hash, w2.median_us) == (w.id, "flashinfer", "f1", 2.0)
    assert store.winners() == [w2]
    assert _winner(store, ids, {"triton": "5c9a"}) is None  # no current source measured
    assert store.winners() == []


def test_winner_ties_go_to_the_earlier_trial(store, ids):
    first = _record(store, ids, {"c": 1}, median=5.0)
    _record(store, ids, {"c": 2}, median=5.0)
    assert _winner(store, ids, {"triton": "5c1a"}).trial_id == first


def test_a_remeasure_keeps_the_better_timing_and_both_medians(store, ids):
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
    assert (rows[c].median_us, rows[c].first_median_us, rows[c].remeasured_at) == (
        10.8, None, None)
    assert _winner(store, ids, {"triton": "5c1a"}).trial_id == b
    # A second re-timing keeps the very first median and the best timing so far.
    store.record_remeasure({a: _stats(9.0), b: _stats(9.8)})
    rows = {t.id: t for t in store.trials()}
    assert (rows[a].median_us, rows[a].first_median_us, rows[a].runoff_median_us) == (
        9.0, 10.0, 9.0)
    assert (rows[b].median_us, rows[b].first_median_us, rows[b].runoff_median_us) == (
        9.5, 10.5, 9.8)
    assert _winner(store, ids, {"triton": "5c1a"}).trial_id == a


def test_a_trial_marked_wrong_keeps_its_median_and_never_wins(store, ids):
    fast = _record(store, ids, {"c": 1}, median=9.0)
    slow = _record(store, ids, {"c": 2}, median=10.0)
    store.mark_wrong(fast, "wrong when built again", max_abs_err=2.0, mismatch_frac=0.5)
    t = {t.id: t for t in store.trials()}[fast]
    assert (t.status, t.median_us, t.first_median_us, t.max_abs_err) == ("wrong", None, 9.0, 2.0)
    assert _winner(store, ids, {"triton": "5c1a"}).trial_id == slow
    with pytest.raises(ValueError, match="not a stored 'ok' trial"):
        store.mark_wrong(fast, "again")


def test_failed_trials_are_deleted_to_be_measured_again(store, ids):
    g = _group(ids)
    _record(store, ids, {"c": 1}, median=9.0)
    _record(store, ids, {"c": 2}, status="failed")
    _record(store, ids, {"c": 3}, status="timeout")
    _record(store, ids, {"c": 4}, status="failed", source="5c2a")
    assert store.delete_trials(g, ["failed"]) == 1 and store.delete_trials(g, []) == 0
    assert sorted((t.source_hash, t.config["c"]) for t in store.trials()) == [
        ("5c1a", 1), ("5c1a", 3), ("5c2a", 4)]
    store.enqueue(g, [{"c": 2}, {"c": 3}])  # measured again: only the deleted one queues
    assert [c.config for c in store.claims(g)] == [{"c": 2}]


def test_superseding_a_groups_timings_drops_them_and_the_winner_naming_one(store, ids):
    g = _group(ids)
    _record(store, ids, {"c": 1}, median=5.0)
    _record(store, ids, {"c": 2}, status="wrong")
    _record(store, ids, {"c": 3}, median=8.0, backend="torch", source="70")
    _record(store, ids, {"c": 4}, median=4.0, source="5c2a")  # another source: kept
    assert _winner(store, ids, {"triton": "5c1a", "torch": "70"}).config == {"c": 1}
    assert store.supersede_timings(g) == 1
    assert store.winners() == []  # it named a superseded trial
    assert sorted((t.backend, t.source_hash, t.config["c"], t.status) for t in store.trials()
                  ) == [("torch", "70", 3, "ok"), ("triton", "5c1a", 2, "wrong"),
                        ("triton", "5c2a", 4, "ok")]
    _record(store, ids, {"c": 1}, median=6.0)  # measured again: the new timing stands
    assert _winner(store, ids, {"triton": "5c1a"}).median_us == 6.0
    # A winner of another group of the shape stays when nothing it names goes.
    _winner(store, ids, {"torch": "70"})
    assert store.supersede_timings(g) == 1 and [w.backend for w in store.winners()] == ["torch"]


def test_winners_filter_and_carry_their_device_and_stack(store, ids):
    other_dev = DeviceFingerprint("amd", "MI355X", "gfx950", 256, 288 << 30)
    other_ids = {"device_id": store.device_id(other_dev), "software_id": ids["software_id"]}
    store.set_read_bandwidth(ids["device_id"], 4000.0)
    for i in (ids, other_ids):
        _record(store, i, {"c": 1})
        _winner(store, i, {"triton": "5c1a"})
    assert len(store.winners()) == 2
    [w] = store.winners(device_hash=GPU.hash)
    assert w.device == GPU and w.device_read_bw_gbps == 4000.0
    assert w.software.as_dict()["torch"] == "2.9.0"
    assert [x.device for x in store.winners(device_hash=other_dev.hash,
                                            software_hash=STACK.hash,
                                            shape_key=SHAPE_KEY)] == [other_dev]
    assert store.winners(software_hash="0" * 16) == []
    assert store.winners(shape_key="nope") == []


def test_a_damaged_row_is_skipped_and_listed_not_fatal(url, store, ids):
    good = _record(store, ids, {"c": 1}, median=9.0)
    bad = _record(store, ids, {"c": 2}, median=5.0)
    _sql(url, "UPDATE mt_trials SET config_json = '[not json' WHERE id = :i", i=bad)
    assert [t.id for t in store.trials()] == [good]
    assert any(f"trial {bad} " in s and "config_json" in s for s in store.skipped)
    # A damaged trial is not a candidate: the next fastest wins.
    assert _winner(store, ids, {"triton": "5c1a"}).trial_id == good
    _sql(url, "UPDATE mt_winners SET config_json = '{}{}'")
    assert store.winners() == []
    assert any(s.startswith("winner ") for s in store.skipped)


# Read-only


_READS = {"url", "close", "skipped", "devices", "claims", "spent", "trials", "measured",
          "winners", "sources"}


def test_read_only_reads_what_was_written_and_refuses_every_write(url):
    with TuningStore(url) as rw:
        ids = {"device_id": rw.device_id(GPU), "software_id": rw.software_id(STACK)}
        g = _group(ids)
        tid = _record(rw, ids, {"c": 1}, median=12.5)
        rw.enqueue(g, CONFIGS[1:])
        assert _winner(rw, ids, {"triton": "5c1a"}) is not None
        expected = (rw.winners(), rw.trials(), rw.devices(), rw.claims(g), rw.sources())
    with TuningStore(url, read_only=True) as ro:
        assert ro.read_only
        assert (ro.winners(), ro.trials(), ro.devices(), ro.claims(g), ro.sources()) == expected
        assert ro.spent(g, stale_after_s=60) == 1 and set(ro.measured(g)) == {'{"c":1}'}
        writes = {
            "optuna_storage": lambda: ro.optuna_storage(),
            "device_id": lambda: ro.device_id(GPU),
            "software_id": lambda: ro.software_id(STACK),
            "set_read_bandwidth": lambda: ro.set_read_bandwidth(ids["device_id"], 4000.0),
            "enqueue": lambda: ro.enqueue(g, [{"c": 9}]),
            "claim": lambda: ro.claim(g, "me", stale_after_s=60),
            "heartbeat": lambda: ro.heartbeat("me"),
            "release": lambda: ro.release("me"),
            "record_trial": lambda: ro.record_trial(g, _result({"c": 8}, "failed")),
            "record_remeasure": lambda: ro.record_remeasure({tid: _stats(1.0)}),
            "mark_wrong": lambda: ro.mark_wrong(tid, "no"),
            "delete_trials": lambda: ro.delete_trials(g, ["failed"]),
            "supersede_timings": lambda: ro.supersede_timings(g),
            "replace_winner": lambda: _winner(ro, ids, {"triton": "5c1a"}),
            "delete_sources": lambda: ro.delete_sources([("triton", "5c1a")]),
            "rename_source": lambda: ro.rename_source("triton", "5c1a", "5c2a"),
            "compact": lambda: ro.compact(),
        }
        # Every method of the contract is either a read or refused here.
        assert set(writes) | _READS == set(BaseTuningStore.__abstractmethods__)
        for name, call in writes.items():
            with pytest.raises(DBError, match=f"cannot {name}: .* opened read-only"):
                call()
    with TuningStore(url) as rw:
        assert (rw.winners(), rw.trials(), rw.devices(), rw.claims(g), rw.sources()) == expected


# Maintenance


def test_deleting_sources_keeps_what_winners_name_and_other_sources(store, ids):
    for i in range(3):
        _record(store, ids, {"i": i}, median=5.0 + i, source="f0d")
        _record(store, ids, {"i": i}, median=9.0 + i, source="a4e")
    store.enqueue(_group(ids, source="f0d"), [{"i": 7}])
    win = _winner(store, ids, {"triton": "f0d"})
    by_source = {r.source_hash: r for r in store.sources()}
    assert {h: (r.trials, r.named_by_winners) for h, r in by_source.items()} == {
        "f0d": (3, 1), "a4e": (3, 0)}
    assert by_source["a4e"].newest_trial_id > by_source["f0d"].newest_trial_id

    gone = store.delete_sources([("triton", "f0d")])
    assert (gone.trials, gone.claims, gone.kept_for_winners) == (2, 1, 1)
    assert sorted((t.source_hash, t.config["i"]) for t in store.trials()) == [
        ("a4e", 0), ("a4e", 1), ("a4e", 2), ("f0d", 0)]
    assert [w.trial_id for w in store.winners()] == [win.trial_id]
    assert store.delete_sources([]) == DeletedRows(0, 0, 0)
    store.compact()  # the data is unchanged
    assert len(store.trials()) == 4 and store.winners() == [win]


def test_renaming_a_source_moves_its_rows_but_never_onto_a_taken_key(store, ids):
    for i in range(3):
        _record(store, ids, {"i": i}, median=5.0 + i, source="b7e5")
    _record(store, ids, {"i": 2}, median=1.0, source="c0de")  # the new hash measured i=2
    _record(store, ids, {"i": 0}, median=4.0, backend="flashinfer", source="b7e5")
    store.enqueue(_group(ids, source="b7e5"), [{"i": 7}])
    _winner(store, ids, {"triton": "b7e5"})

    done = store.rename_source("triton", "b7e5", "c0de")
    assert (done.trials, done.winners, done.claims, done.left) == (2, 1, 1, 1)
    assert sorted((t.backend, t.source_hash, t.config["i"]) for t in store.trials()) == [
        ("flashinfer", "b7e5", 0), ("triton", "b7e5", 2), ("triton", "c0de", 0),
        ("triton", "c0de", 1), ("triton", "c0de", 2)]
    (winner,) = store.winners()
    assert (winner.source_hash, winner.config) == ("c0de", {"i": 0})
    assert [c.config for c in store.claims(_group(ids, source="c0de"))] == [{"i": 7}]
    again = store.rename_source("triton", "b7e5", "c0de")
    assert (again.trials, again.winners, again.claims, again.left) == (0, 0, 0, 1)
