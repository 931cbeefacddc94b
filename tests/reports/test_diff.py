"""`mla-tune diff`: winners before/after, regressions only beyond the measured noise."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from mla_tune.cli.main import app
from mla_tune.db import TrialGroup, TrialResult, TuningStore
from mla_tune.machine.fingerprint import SoftwareFingerprint
from mla_tune.problem.shapes import Shape
from mla_tune.reports.diff import DiffSide, classify, compare, noise_us, summarize_diff
from mla_tune.reports.table import report_rows
from mla_tune.results.selection import update_winner
from tests.fixtures.sweep_db import SHAPES, copy_db, swept_db

runner = CliRunner()
BF16, FP8 = SHAPES
NEW = Shape.uniform(2, 128)


def _add_stack(store: TuningStore, scale: dict[str, float]) -> str:
    """Copy the swept trials into a second software stack (triton bumped), each shape's
    times (not their spread) multiplied by `scale[shape_key]` (shapes not in `scale` are
    left out), plus one shape only this stack has; returns the new stack's hash."""
    (old,) = {w.software for w in store.winners()}
    versions = dict(old.versions) | {"triton": "9.9.9"}
    fp = SoftwareFingerprint(tuple(versions.items()))
    sw = store.software_id(fp)
    (dev,) = store.devices()
    trials = [t for t in store.trials() if t.shape_key in scale] + store.trials(
        shape_key=BF16.key)[:1]
    for i, t in enumerate(trials):
        last = i == len(trials) - 1
        key, shape_json = (NEW.key, NEW.to_json()) if last else (t.shape_key, t.shape_json)
        k = 1.0 if last else scale[t.shape_key]
        stats = None if t.status != "ok" else {
            s: (getattr(t, s) * k if s.endswith("_us") and s != "std_us" else getattr(t, s))
            for s in ("median_us", "mean_us", "std_us", "min_us", "max_us", "n")}
        store.record_trial(TrialGroup(dev.id, sw, key, t.backend, t.source_hash),
                           TrialResult(shape_json, t.kv_format, t.config, t.status,
                                       stats=stats))
    sources = {"torch": trials[0].source_hash}
    for key in [*scale, NEW.key]:
        update_winner(store, dev.id, sw, key, sources)
    return fp.hash


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """One DB with two stacks: fp8 10x slower under the new one (far beyond CPU timing
    noise), bf16 unchanged, one new shape. Returns (store, old hash, new hash)."""
    store = swept_db(tmp_path_factory.mktemp("diff") / "t.db")
    (old,) = {w.software.hash for w in store.winners()}
    new = _add_stack(store, {BF16.key: 1.0, FP8.key: 10.0})
    return store, old, new


def test_classify_needs_both_noise_and_min_change(stacks):
    base = report_rows(stacks[0])[0]

    def row(median: float, std: float | None = 10.0, n: int | None = 10):
        return dataclasses.replace(base, winner=dataclasses.replace(base.winner, median_us=median),
                                   std_us=std, n=n)

    before = row(100.0)  # 95% CI half-width 2.262 * 10 / sqrt(10) = 7.154 us
    noise = noise_us(before, row(100.0))
    assert noise == pytest.approx(7.154 * 2**0.5, rel=1e-3)
    assert classify(before, row(109.0), 0.0) == ("same", noise)  # within the noise
    assert classify(before, row(111.0), 0.0)[0] == "regression"
    assert classify(before, row(111.0), 0.2)[0] == "same"  # below the minimum change
    assert classify(before, row(89.0), 0.0)[0] == "improvement"
    assert classify(before, row(102.0, None, None), 0.01) == ("regression", None)


def test_a_winners_two_timings_count_as_noise(stacks):
    base = report_rows(stacks[0])[0]
    win = next(t for t in base.trials if t.id == base.trial_id)

    def row(median: float, first: float | None = None, runoff: float | None = None):
        timed = dataclasses.replace(win, first_median_us=first, runoff_median_us=runoff)
        return dataclasses.replace(base, winner=dataclasses.replace(base.winner, median_us=median),
                                   std_us=1.0, n=10, trials=(timed,))

    ci = noise_us(row(100.0), row(100.0))  # 2.262 * 1 / sqrt(10) * sqrt(2) = 1.01 us
    assert ci == pytest.approx(1.0116, rel=1e-3)
    # The same winner once timed 100 and once 108 us: an 8 % move is noise, not a regression.
    spread = row(100.0, first=108.0, runoff=100.0)
    assert row(100.0).moment_spread_us is None and spread.moment_spread_us == 8.0
    assert noise_us(spread, row(107.0)) == 8.0
    assert classify(spread, row(107.0), 0.03) == ("same", 8.0)
    assert classify(row(100.0), row(107.0), 0.03)[0] == "regression"
    assert classify(spread, row(109.0), 0.03)[0] == "regression"
    assert noise_us(row(100.0, 100.5, 100.0), row(100.0)) == pytest.approx(ci)  # CI larger


def test_two_stacks_in_one_db(stacks):
    store, old, new = stacks
    before, after = DiffSide.load(store, "old", old), DiffSide.load(store, "new", new)
    rows = {d.shape.key: d for d in compare(before, after)}
    assert {k: d.status for k, d in rows.items()} == {
        BF16.key: "same", FP8.key: "regression", NEW.key: "new"}
    fp8 = rows[FP8.key]
    assert fp8.change == pytest.approx(9.0) and not fp8.winner_changed
    assert fp8.after.median_us == pytest.approx(10 * fp8.before.median_us)
    assert fp8.noise_us == pytest.approx(noise_us(fp8.before, fp8.after))
    (g_bf16,) = [g for g in summarize_diff(list(rows.values())) if g.kv_format == "bf16"]
    assert g_bf16.shapes == 1 and g_bf16.change == pytest.approx(0.0)
    # The whole DB: each shape's most recently updated winner, i.e. the new stack's.
    latest = DiffSide.load(store, "db")
    assert {r.software_hash for r in latest.rows} == {new}


def test_cli_diff_stacks_and_dbs(stacks, tmp_path):
    store, old, new = stacks
    db = store.url.removeprefix("sqlite:///")
    r = runner.invoke(app, ["diff", old[:8], new[:8], "--db", db], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "regression" in r.stdout and "triton 3.6.0 -> 9.9.9" in r.stdout
    assert "1 regression, 0 improvement, 1 same, 1 new, 0 gone" in r.stdout
    r = runner.invoke(app, ["diff", old, new, "--db", db, "--fail-on-regression"])
    assert r.exit_code == 1
    r = runner.invoke(app, ["diff", new, old, "--db", db, "--format", "json"])
    data = json.loads(r.stdout)
    assert {d["shape_key"]: d["status"] for d in data["rows"]} == {
        BF16.key: "same", FP8.key: "improvement", NEW.key: "gone"}
    copy = copy_db(store, tmp_path / "copy.db")
    r = runner.invoke(app, ["diff", db, copy.url, "--format", "json", "--fail-on-regression"])
    assert r.exit_code == 0, r.output
    assert {d["status"] for d in json.loads(r.stdout)["rows"]} == {"same"}
    for args, message in ((["abcd1234", new], "no software stack"),
                          ([str(tmp_path / "missing.db"), db], "neither")):
        r = runner.invoke(app, ["diff", *args, "--db", db])
        assert r.exit_code == 2 and message in r.output
    assert not (tmp_path / "missing.db").exists()
