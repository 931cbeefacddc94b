"""The report's numbers, checked against the trials a real CPU sweep stored."""

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_tune.cli.main import app
from mla_tune.db import TrialGroup, TrialResult
from mla_tune.machine.bandwidth import measure_read_bandwidth
from mla_tune.problem.shapes import Shape
from mla_tune.reports.table import (
    THIN_ELSEWHERE,
    ci95_halfwidth,
    geomean,
    report_rows,
    suite_summaries,
    t95,
    thin_sweeps,
)
from tests.fixtures.sweep_db import SHAPES, copy_db, swept_db

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
# Two-sided 95% Student-t quantiles (standard tables).
T95 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 7: 2.3646, 9: 2.2622,
       10: 2.2281, 12: 2.1788, 15: 2.1314, 23: 2.0687, 30: 2.0423, 1000: 1.9623}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return swept_db(tmp_path_factory.mktemp("report") / "t.db")


def test_t_quantiles_match_tables():
    for dof, t in T95.items():
        assert t95(dof) == pytest.approx(t, abs=1e-4)
    assert ci95_halfwidth(2.0, 5) == pytest.approx(T95[4] * 2.0 / math.sqrt(5), rel=1e-4)
    assert ci95_halfwidth(2.0, 1) is None and ci95_halfwidth(None, 5) is None


def test_rows_match_stored_trials(store):
    rows = report_rows(store)
    assert sorted(r.shape.key for r in rows) == sorted(s.key for s in SHAPES)
    for r in rows:
        trials = store.trials(shape_key=r.shape.key)
        ok = [t for t in trials if t.status == "ok"]
        best = min(ok, key=lambda t: (t.median_us, t.id))
        assert (r.backend, r.config, r.median_us) == (best.backend, best.config, best.median_us)
        assert (r.mean_us, r.std_us, r.n) == (best.mean_us, best.std_us, best.n)
        assert r.ci95_us == pytest.approx(T95[best.n - 1] * best.std_us / math.sqrt(best.n),
                                          rel=1e-4)
        assert r.eff_gbps == pytest.approx(r.shape.kv_bytes / best.median_us / 1e3)
        assert r.counts == dict(Counter(t.status for t in trials))
        assert sum(r.counts.values()) == len(trials) == 6
        assert r.torch_us == best.median_us and r.speedup_vs_torch == 1.0
        assert r.baseline_backend == "torch" and r.speedup_vs_baseline == 1.0
        assert r.pct_of_read_bw is None  # a CPU has no measured roofline
        by_splits: dict[int, float] = {}
        for t in ok:
            s = t.config["num_splits"]
            by_splits[s] = min(by_splits.get(s, math.inf), t.median_us)
        assert r.knob_spread["num_splits"] == pytest.approx(
            max(by_splits.values()) / min(by_splits.values()))
        # Knobs whose correct variants differ (the bf16-compute torch variants are wrong
        # on the bf16 shape's ragged probe batch, so compute_dtype varies only for fp8).
        varied = {k for k in ok[0].config if len({t.config[k] for t in ok}) > 1}
        assert set(r.knob_spread) == varied and {"num_splits", "chunk_size"} <= varied
        data = r.to_json()
        assert data["ci95_us"] == r.ci95_us and data["trials"] == r.counts


def test_percent_of_read_bandwidth_uses_the_stored_ceiling(store, tmp_path):
    copy = copy_db(store, tmp_path / "bw.db")
    copy.set_read_bandwidth(copy.devices()[0].id, 123.0)
    rows = report_rows(copy)
    assert len(rows) == len(SHAPES)
    for row in rows:
        assert row.pct_of_read_bw == pytest.approx(100 * row.eff_gbps / 123.0)


def test_suite_geomeans_count_missing_shapes(store):
    rows = report_rows(store)
    suite = [Shape.uniform(2, 512), Shape.uniform(8, 512)]
    summaries = {s.kv_format: s for s in suite_summaries(rows, suite)}
    assert set(summaries) == {"bf16", "fp8", "all"}
    for fmt in ("bf16", "fp8"):
        s = summaries[fmt]
        (r,) = [r for r in rows if r.shape.kv_format.value == fmt]
        assert (s.shapes, s.missing, s.geomean_us) == (1, 1, pytest.approx(r.median_us))
    both = summaries["all"]
    assert both.missing == 2 and both.shapes == 2
    assert both.geomean_us == pytest.approx(math.sqrt(rows[0].median_us * rows[1].median_us))
    assert geomean([2.0, 8.0]) == pytest.approx(4.0) and geomean([]) is None


def test_cli_report_suite_filter_and_geomean(store, tmp_path):
    db = store.url.removeprefix("sqlite:///")
    r = runner.invoke(app, ["report", "--db", db, "--format", "json", "--suite", "tiny"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == []  # tiny has no 2x512
    r = runner.invoke(app, ["report", "--db", db], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "geometric mean bf16" in r.stdout and "±95%" in r.stdout
    r = runner.invoke(app, ["report", "--db", db, "--suite", "nope"])
    assert r.exit_code == 2 and "unknown suite" in r.output


def test_superseded_winners_are_marked_and_left_out_of_geomeans(store, tmp_path):
    """A newer source of the winners' backend, measured anywhere in the DB, supersedes them:
    they are marked in every output and left out of geomeans and the roofline."""
    from mla_tune.reports.html import render_html, roofline_figures

    copy = copy_db(store, tmp_path / "superseded.db")
    assert not any(r.superseded for r in report_rows(copy))
    t = copy.trials(shape_key=SHAPES[0].key)[0]
    copy.record_trial(TrialGroup(t.device_id, t.software_id, t.shape_key, t.backend, "f" * 16),
                      TrialResult(t.shape_json, t.kv_format, t.config, "ok",
                                  stats={"median_us": 1.0}))
    rows = report_rows(copy)
    assert len(rows) == len(SHAPES) and all(r.superseded for r in rows)
    assert rows[0].winner_label == f"{rows[0].backend} (superseded)"
    assert rows[0].to_json()["superseded"] is True
    summaries = suite_summaries(rows)
    assert {(s.kv_format, s.shapes, s.superseded, s.geomean_us) for s in summaries} == {
        ("bf16", 0, 1, None), ("fp8", 0, 1, None), ("all", 0, 2, None)}
    assert not roofline_figures(rows, {})
    assert "(superseded)" in render_html(copy, rows)
    db = copy.url.removeprefix("sqlite:///")
    r = runner.invoke(app, ["report", "--db", db], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert f"{rows[0].backend}*" in r.stdout and "* superseded" in r.stdout
    assert "µs over" not in r.stdout
    assert "no current winners (1 superseded winners left out)" in r.stdout


def test_thin_sweeps_name_the_shapes_a_family_barely_swept(store, tmp_path):
    """A family timed at many variants of one bf16 shape and one variant of another is
    named with that other shape; the fp8 shape, where it never ran, and torch, whose few
    variants are all it has, are not; timed as widely at both shapes, nothing is named."""
    copy = copy_db(store, tmp_path / "thin.db")
    t = copy.trials(shape_key=SHAPES[0].key)[0]
    wide = Shape.uniform(4, 512, kv_format="bf16")

    def add(shape: Shape, n: int) -> None:
        for i in range(n):
            copy.record_trial(
                TrialGroup(t.device_id, t.software_id, shape.key, "triton", "a" * 16),
                TrialResult(shape.to_json(), shape.kv_format.value, {"block_n": i}, "ok",
                            stats={"median_us": 1e6 + i}))

    add(wide, THIN_ELSEWHERE + 1)
    copy.replace_winner(t.device_id, t.software_id, wide.key, {"triton": "a" * 16},
                        lambda trials: trials[0])
    add(SHAPES[0], 1)
    rows = report_rows(copy)
    row = next(r for r in rows if r.shape.key == SHAPES[0].key)
    assert row.family_trials == {"torch": row.counts["ok"] - 1, "triton": 1}
    assert row.to_json()["family_trials"] == row.family_trials
    (line,) = thin_sweeps(rows)
    assert line.startswith("thin sweeps: triton has at most 2 timed trials at 1 shape(s) "
                           f"({SHAPES[0].label()}: 1)")
    assert f"up to {THIN_ELSEWHERE + 1}" in line
    assert thin_sweeps(rows, [r for r in rows if r.shape.key == wide.key]) == []
    db = copy.url.removeprefix("sqlite:///")
    r = runner.invoke(app, ["report", "--db", db, "--columns", "shape,families"],
                      env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    assert "thin sweeps: triton" in r.stdout and "triton:1" in r.stdout
    from mla_tune.reports.html import render_html

    assert "thin sweeps: triton" in render_html(copy, rows)
    add(SHAPES[0], THIN_ELSEWHERE)
    assert thin_sweeps(report_rows(copy)) == []


def test_read_bandwidth_is_none_on_cpu():
    assert measure_read_bandwidth("cpu") is None


def test_read_reduce_kernel_sums_every_element_in_the_interpreter():
    code = ("import torch\nfrom mla_tune.machine.bandwidth import read_reduce\n"
            "x = torch.randn(70001, generator=torch.Generator().manual_seed(0))\n"
            "for b, i, w in [(4096, 16, 8), (256, 4, 4)]:\n"
            "    p = read_reduce(x, b, i, w)\n"
            "    assert p.numel() == -(-x.numel() // (b * i))\n"
            "    assert abs(float(p.double().sum()) - float(x.double().sum())) < 1e-2\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_tma_reader_sums_every_element_in_the_interpreter():
    """The TMA reader, the fastest on an H200 (bench/results/read_ceiling.md), reads every
    tile, the last one past the end as zeros, whatever the program count."""
    code = ("import torch\nfrom mla_tune.machine.bandwidth import tma_read_reduce\n"
            "x = torch.randn(256 * 100, generator=torch.Generator().manual_seed(0))\n"
            "for rows, stages, programs in [(32, 3, 2), (64, 2, 3), (32, 4, 1000)]:\n"
            "    p = tma_read_reduce(x, rows, stages, programs)\n"
            "    assert p.numel() == min(programs, -(-100 // rows)), p.numel()\n"
            "    assert abs(float(p.double().sum()) - float(x.double().sum())) < 1e-2\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
