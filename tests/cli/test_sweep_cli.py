"""End-to-end CLI runs on a temporary SQLite DB (real torch family on CPU)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mla_tune.cli.main import app
from mla_tune.db import TuningStore

runner = CliRunner()
FAST = ["--time-budget", "0.02", "--device", "cpu"]


def _sweep(db, *extra):
    return runner.invoke(app, ["sweep", "--db", str(db), *FAST, *extra])


@pytest.mark.parametrize("width", ["40", "200"])
def test_the_winners_print_whole_at_any_terminal_width(tmp_path, width):
    """Each winner's time and config come out whole (no cell cut to an ellipsis): the
    config as its own line under the table, the table's cells folding."""
    db = tmp_path / "tuning.db"
    r = runner.invoke(app, ["sweep", "--db", str(db), *FAST, "--shape", "2x64", "-f", "bf16",
                            "--backend", "torch"], env={"COLUMNS": width})
    assert r.exit_code == 0, r.output
    (w,) = TuningStore(str(db)).winners()
    config = " ".join(f"{k}={v}" for k, v in sorted(w.config.items()))
    assert f"  2x64 bf16 h16 q1 torch: {config}\n" in r.stdout
    assert f"{w.median_us:.1f}" in r.stdout and "…" not in r.stdout


def test_sweep_then_report_one_winner_per_format_and_no_duplicates(tmp_path):
    db = tmp_path / "tuning.db"
    r = _sweep(db, "--shape", "4x64", "--backend", "torch")
    assert r.exit_code == 0, r.output
    n_trials = len(TuningStore(str(db)).trials())
    assert n_trials > 0
    rep = runner.invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert rep.exit_code == 0, rep.output
    rows = json.loads(rep.stdout)
    assert sorted(r["shape_key"] for r in rows) == [
        "b4-q1-kv64-h16-bf16-p1", "b4-q1-kv64-h16-fp8-p1", "b4-q1-kv64-h16-mxfp4-p1"]
    assert all(r["backend"] == "torch" and r["median_us"] > 0 for r in rows)
    r2 = _sweep(db, "--shape", "4x64", "--backend", "torch")
    assert r2.exit_code == 0, r2.output
    assert len(TuningStore(str(db)).trials()) == n_trials
    table = runner.invoke(app, ["report", "--db", str(db)], env={"COLUMNS": "250"})
    assert table.exit_code == 0 and "4x64 fp8" in table.stdout


@pytest.fixture(scope="module")
def seeded_db(tmp_path_factory):
    """A DB holding one sweep, made once (a sweep starts worker processes): each bad-input
    case gets its own copy."""
    db = tmp_path_factory.mktemp("seeded") / "tuning.db"
    assert _sweep(db, "--shape", "2x32", "--backend", "torch", "-f", "bf16").exit_code == 0
    return db


@pytest.mark.parametrize("args, message", [
    (["--shape", "256x"], "bad shape"),
    (["--shape", "0x8192"], "bad shape"),
    (["--shape", "-4x1024"], "bad shape"),
    (["--shape", "4x1024x9"], "bad shape"),
    (["--shape", "4x64", "--backend", "nope"], "unknown backend"),
    (["--shape", "4x64", "--kv-format", "int4"], "unknown kv format"),
    (["--suite", "nope"], "unknown suite"),
    (["--shape", "4x64", "--strategy", "annealing"], "unknown strategy"),
    (["--shape", "4x64", "--gpus", "2"], "--gpus needs --device cuda"),
    (["--shape", "4x64", "--pin", "torch.num_splits=3"], "--pin"),
    (["--shape", "4x64", "--pin", "torch.warp_size=1"], "unknown parameter"),
    (["--shape", "4x64", "--pin", "num_splits=1"], "bad pin"),
    (["--shape", "4x64", "--retry", "ok"], "--retry takes failed, timeout or wrong"),
    (["--shape", "4x64", "--between-calls", "sleep"], "--between-calls"),
])
def test_bad_input_exits_2_and_leaves_db_unchanged(tmp_path, seeded_db, args, message):
    db = tmp_path / "tuning.db"
    shutil.copy(seeded_db, db)
    before = db.read_bytes()
    r = _sweep(db, *args)
    assert r.exit_code == 2
    assert message in r.output
    assert db.read_bytes() == before


def test_pins_narrow_the_candidates(tmp_path):
    db = tmp_path / "tuning.db"
    r = _sweep(db, "--shape", "2x512", "-f", "bf16", "--backend", "torch", "--no-baseline",
               "--pin", "torch.num_splits=1", "--pin", "torch.compute_dtype=float32")
    assert r.exit_code == 0, r.output
    configs = [t.config for t in TuningStore(str(db)).trials()]
    assert configs and all(c["num_splits"] == 1 and c["compute_dtype"] == "float32"
                           for c in configs)
    assert len(configs) == 2  # chunk_size 0 and 256 remain


def test_dry_run_lists_candidates_and_stores_nothing(tmp_path):
    from mla_tune.backends import get_backend
    from mla_tune.problem.shapes import Shape

    db = tmp_path / "tuning.db"
    r = runner.invoke(app, ["sweep", "--db", str(db), "--device", "cpu", "--shape", "4x1024",
                            "-f", "fp8", "--backend", "torch", "--dry-run",
                            "--pin", "torch.num_splits=1"],
                      env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    expected = len(get_backend("torch").candidates(Shape.uniform(4, 1024, kv_format="fp8"),
                                                   "cpu", {"num_splits": [1]}))
    assert f"{expected} candidates in all" in r.stdout and expected > 0
    assert "skipped flashinfer" in r.output
    assert not db.exists()
    # On a narrow terminal too, each row whole; backends that cannot run here are no column.
    narrow = runner.invoke(app, ["sweep", "--db", str(db), "--device", "cpu", "--shape",
                                 "4x1024", "-f", "fp8", "--dry-run"], env={"COLUMNS": "40"})
    assert narrow.exit_code == 0, narrow.output
    (row,) = [line for line in narrow.stdout.splitlines() if "4x1024 fp8 h16 q1" in line]
    header = narrow.stdout.splitlines()[narrow.stdout.splitlines().index(row) - 2]
    assert row.split()[-1].isdigit() and "…" not in narrow.stdout
    assert "torch" in header and "flashinfer" not in header


def test_a_suite_runs_in_its_own_formats_unless_the_formats_are_named(tmp_path):
    """leaderboard-v2 names no format (bf16); `-f all` sweeps it in all three, so the
    formats of each call can run off together."""
    def planned(*formats):
        r = runner.invoke(app, ["sweep", "--db", str(tmp_path / "t.db"), "--device", "cpu",
                                "--suite", "leaderboard-v2", "--backend", "torch",
                                "--dry-run", *formats], env={"COLUMNS": "250"})
        assert r.exit_code == 0, r.output
        return {f for f in ("bf16", "fp8", "mxfp4") if f"4x8192 {f} h32 q4" in r.stdout}

    assert planned() == {"bf16"}
    assert planned("-f", "all") == {"bf16", "fp8", "mxfp4"}
    assert planned("-f", "fp8") == {"fp8"}


def test_non_sqlite_and_unreadable_db_are_refused(tmp_path):
    bogus = tmp_path / "notes.db"
    bogus.write_text("this is not a database\n")
    r = _sweep(bogus, "--shape", "2x32", "--backend", "torch")
    assert r.exit_code == 2 and "SQLite" in r.output
    assert bogus.read_text() == "this is not a database\n"
    r = runner.invoke(app, ["report", "--db", str(tmp_path)])
    assert r.exit_code == 2


def test_module_entry_point_and_doctor(seeded_db):
    r = subprocess.run([sys.executable, "-m", "mla_tune", "doctor", "--device", "cpu",
                        "--db", str(seeded_db)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout and "backends" in r.stdout
    assert "winners usable here: 1 tuned shape(s)" in r.stdout
