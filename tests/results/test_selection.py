"""`mla_tune.results.selection`: the fastest correct trial wins, ties to the earlier one (the
store side, with real DBs: tests/db/test_storage_contract.py)."""

from dataclasses import replace
from datetime import datetime, timezone

from mla_tune.db import TrialRow
from mla_tune.results.selection import fastest_correct

_T = TrialRow(id=1, device_id=1, software_id=1, shape_key="k", shape_json={}, kv_format="bf16",
              backend="triton", source_hash="s", config={}, config_key="{}", status="ok",
              median_us=10.0, mean_us=None, std_us=None, min_us=None, max_us=None, n=None,
              max_abs_err=None, mismatch_frac=None, error=None, worker=None,
              created_at=datetime(2026, 1, 1, tzinfo=timezone.utc))


def test_the_fastest_ok_trial_wins_and_a_tie_goes_to_the_earlier() -> None:
    trials = [replace(_T, id=5, median_us=3.0), replace(_T, id=2, median_us=3.0),
              replace(_T, id=3, median_us=1.0, status="wrong"),
              replace(_T, id=4, median_us=None, status="failed"),
              replace(_T, id=6, median_us=4.0)]
    assert fastest_correct(trials).id == 2


def test_no_ok_trial_means_no_winner() -> None:
    assert fastest_correct([]) is None
    assert fastest_correct([replace(_T, status="timeout", median_us=None),
                            replace(_T, id=2, status="wrong", median_us=1.0)]) is None
