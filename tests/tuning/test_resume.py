"""A sweep killed at any moment finishes on re-run with no trial lost or measured twice,
Ctrl-C stops it cleanly, and two sweeps on one DB (SQLite or PostgreSQL) share the work.

Each test runs the real CLI in subprocesses with the `slow` test backend (10 correct
configs per shape, 0.2-0.3 s per build), which logs every build to a file: the log is the
ground truth for "measured once"."""

import collections
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from mla_tune.db import TuningStore
from tests.fixtures.fault_backends import BUILD_DELAY_ENV, BUILD_LOG_ENV

REPO = Path(__file__).resolve().parents[2]
CONFIGS_PER_SHAPE = 10


def _env(log: Path, build_s: str = "0.3") -> dict[str, str]:
    # TMPDIR: a killed sweep cannot remove its workers' log directory; keep it in tmp_path.
    env = dict(os.environ, MLA_TUNE_EXTRA_BACKENDS="slow=tests.fixtures.fault_backends:SlowBackend",
               PYTHONPATH=str(REPO), TMPDIR=str(log.parent),
               **{BUILD_LOG_ENV: str(log), BUILD_DELAY_ENV: build_s})
    env.pop("MLA_TUNE_DB", None)
    return env


def _cmd(db: str, *shapes: str) -> list[str]:
    # --runoff 0: whether two close finalists are built again for a side-by-side run-off
    # depends on how fast the machine timed them; here every build must be a queue's.
    cmd = [sys.executable, "-m", "mla_tune", "sweep", "--db", db, "--device", "cpu",
           "--backend", "slow", "--no-baseline", "-f", "bf16", "--time-budget", "0.01",
           "--runoff", "0"]
    for s in shapes or ("2x32",):
        cmd += ["--shape", s]
    return cmd


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    # Own process group, like a terminal job: signals reach the driver and its workers.
    return subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _counts(path: Path) -> tuple[int, int]:
    """(stored trials, running claims) of a SQLite DB another process is writing."""
    if not path.exists():
        return 0, 0
    conn = sqlite3.connect(path, timeout=30)
    try:
        trials = conn.execute("SELECT count(*) FROM mt_trials").fetchone()[0]
        running = conn.execute(
            "SELECT count(*) FROM mt_claims WHERE state = 'running'").fetchone()[0]
        return trials, running
    except sqlite3.OperationalError:  # tables not created yet
        return 0, 0
    finally:
        conn.close()


def _wait_mid_sweep(proc: subprocess.Popen, path: Path, trials: int) -> None:
    """Until `trials` are stored and a candidate is running (so a signal lands mid-way)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        done, running = _counts(path)
        if done >= trials and running:
            return
        time.sleep(0.05)
    raise AssertionError(f"sweep never got mid-way: {_counts(path)}, exit {proc.poll()}")


def _table(db: str) -> list[tuple[str, str, str, str]]:
    with TuningStore(db) as s:
        return sorted((t.shape_key, t.backend, t.config_key, t.status) for t in s.trials())


def _built(log: Path) -> list[str]:
    """The candidates built for the swept shapes, as `shape_key config_key` (the log adds
    the worker's pid). The swept shapes here are uniform; builds for a candidate's ragged
    probe batch (key `...-kvr...`, mla_tune/problem/probes.py) are part of its check."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.rsplit(" ", 1)[0] for line in lines if "-kvr" not in line.split(" ", 1)[0]]


def _keys(trials) -> set[str]:
    return {f"{t.shape_key} {t.config_key}" for t in trials}


def test_sigkill_mid_sweep_then_rerun_equals_an_uninterrupted_run(tmp_path):
    full_db, cut_path = str(tmp_path / "full.db"), tmp_path / "cut.db"
    cut_db = str(cut_path)
    full = _start(_cmd(full_db), _env(tmp_path / "full.log"))
    cut = _start(_cmd(cut_db), _env(tmp_path / "cut.log"))
    _wait_mid_sweep(cut, cut_path, trials=3)
    os.killpg(cut.pid, signal.SIGKILL)
    cut.communicate()
    with TuningStore(cut_db) as s:
        before = s.trials()
    assert 3 <= len(before) < CONFIGS_PER_SHAPE
    assert _counts(cut_path)[1] >= 1  # the killed sweep left a claimed candidate behind

    rerun = subprocess.run(_cmd(cut_db), env=_env(tmp_path / "rerun.log"), cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert full.wait(timeout=300) == 0, full.communicate()[1]
    assert _table(cut_db) == _table(full_db)
    assert len(_table(cut_db)) == CONFIGS_PER_SHAPE
    with TuningStore(cut_db) as s:
        after = s.trials()
        winners = s.winners()
    assert all(t in after for t in before)  # nothing stored was lost or rewritten
    rebuilt = _built(tmp_path / "rerun.log")
    assert not set(rebuilt) & _keys(before)  # nothing stored was measured again
    assert len(rebuilt) == len(set(rebuilt)) == CONFIGS_PER_SHAPE - len(before)
    assert len(winners) == 1
    assert winners[0].trial_id in {t.id for t in after if t.status == "ok"}
    assert _counts(cut_path)[1] == 0


def test_ctrl_c_stops_cleanly_and_a_rerun_finishes(tmp_path):
    path = tmp_path / "t.db"
    proc = _start(_cmd(str(path)), _env(tmp_path / "first.log"))
    _wait_mid_sweep(proc, path, trials=2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    said = " ".join(err.split())  # rich wraps lines
    assert "interrupted:" in said and "new trial(s) stored" in said
    assert "went back to the queue. Run the same command again to finish." in said
    stored, running = _counts(path)
    assert stored >= 2 and running == 0  # its claims went back to the queue
    rerun = subprocess.run(_cmd(str(path)), env=_env(tmp_path / "rerun.log"), cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert len(_table(str(path))) == CONFIGS_PER_SHAPE
    with TuningStore(str(path)) as s:
        first = _keys(t for t in s.trials() if t.id <= stored)
    again = _built(tmp_path / "rerun.log")
    assert len(again) == len(set(again)) == CONFIGS_PER_SHAPE - stored
    assert not set(again) & first


def test_ctrl_c_pressed_again_while_stopping_changes_nothing(tmp_path):
    """A second Ctrl-C soon after the first (here 0 to 0.2 s later) is ignored: the clean
    stop finishes, quietly, with the same message and exit code as after one."""
    gaps = (0.0, 0.01, 0.05, 0.2)
    paths = [tmp_path / f"t{i}.db" for i in range(len(gaps))]
    procs = [_start(_cmd(str(p)), _env(tmp_path / f"{i}.log")) for i, p in enumerate(paths)]
    for proc, path, gap in zip(procs, paths, gaps):
        _wait_mid_sweep(proc, path, trials=1)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(gap)
        os.killpg(proc.pid, signal.SIGINT)
    for proc, path, gap in zip(procs, paths, gaps):
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, (gap, err)
        said = " ".join(err.split())
        assert "went back to the queue. Run the same command again to finish." in said, (gap, err)
        assert "Traceback" not in err and "Exception" not in err, (gap, err)
        assert _counts(path)[1] == 0  # its claims went back to the queue


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_db(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "shared.db")
    return request.getfixturevalue("pg_url")


def test_two_sweeps_on_one_db_measure_each_candidate_once(shared_db, tmp_path):
    log = tmp_path / "builds.log"
    shapes = ("2x32", "3x32")
    procs = [_start(_cmd(shared_db, *shapes), _env(log, build_s="0.2")) for _ in range(2)]
    for p in procs:
        _out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    builds = collections.Counter(_built(log))
    assert len(builds) == len(shapes) * CONFIGS_PER_SHAPE
    assert set(builds.values()) == {1}, builds.most_common(3)
    table = _table(shared_db)
    assert len(table) == len(set(table)) == len(shapes) * CONFIGS_PER_SHAPE
    with TuningStore(shared_db) as s:
        assert len(s.winners()) == len(shapes)
        summaries = optuna.get_all_study_summaries(s.optuna_storage())
    # The Optuna mirror got each measurement once too, whichever sweep made it.
    assert sorted(x.n_trials for x in summaries) == [CONFIGS_PER_SHAPE] * len(shapes)
