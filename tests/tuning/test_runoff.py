from datetime import datetime, timezone

from mla_tune.db import TrialRow
from mla_tune.tuning.runoff import finalists, timed_together

T0 = datetime(2026, 11, 30, tzinfo=timezone.utc)


def trial(i: int, backend: str, us: float | None, status: str = "ok",
          remeasured_at: datetime | None = None) -> TrialRow:
    return TrialRow(id=i, device_id=1, software_id=1, shape_key="s", shape_json={},
                    kv_format="bf16", backend=backend, source_hash="h", config={"i": i},
                    config_key=str(i), status=status, median_us=us, mean_us=us, std_us=0.0,
                    min_us=us, max_us=us, n=20, max_abs_err=0.0, mismatch_frac=0.0,
                    error=None, worker=None, created_at=T0, remeasured_at=remeasured_at)


def test_finalists_are_the_close_fastest_then_each_other_backends_fastest():
    trials = [trial(1, "triton", 105.0), trial(2, "triton", 100.0), trial(3, "triton", 114.0),
              trial(4, "triton", 101.0), trial(5, "flashinfer", 300.0),
              trial(6, "flashinfer", 250.0), trial(7, "torch", 900.0),
              trial(8, "triton", 90.0, status="wrong"), trial(9, "triton", None, "failed")]
    assert [t.id for t in finalists(trials, 3)] == [2, 4, 1, 6, 7]
    # Beyond the window a fast-looking trial cannot win the run-off, so it is not timed.
    assert [t.id for t in finalists(trials[:4] + [trial(10, "triton", 200.0)], 5)] == [2, 4, 1, 3]


def test_no_finalists_when_there_is_nothing_to_compare():
    assert finalists([trial(1, "triton", 100.0), trial(2, "triton", 130.0)], 3) == []
    assert finalists([trial(1, "triton", 100.0), trial(2, "triton", 101.0)], 1) == []
    assert finalists([trial(1, "triton", 100.0)], 3) == []
    assert [t.id for t in finalists([trial(1, "triton", 100.0), trial(2, "torch", 500.0)],
                                    3)] == [1, 2]


def test_timed_together_needs_one_shared_run():
    later = datetime(2026, 12, 1, tzinfo=timezone.utc)
    assert timed_together([trial(1, "a", 1.0, remeasured_at=T0),
                           trial(2, "a", 1.0, remeasured_at=T0)])
    assert not timed_together([trial(1, "a", 1.0, remeasured_at=T0),
                               trial(2, "a", 1.0, remeasured_at=later)])
    assert not timed_together([trial(1, "a", 1.0, remeasured_at=T0), trial(2, "a", 1.0)])
    assert not timed_together([trial(1, "a", 1.0), trial(2, "a", 1.0)])

