"""Candidates run in worker processes: a variant that exits, segfaults, hangs or raises is
recorded with its cause, its worker is replaced, and the sweep still finds the winner."""

import os
import subprocess
import sys

import pytest

from mla_tune.backends import get_backend, register
from mla_tune.db import TrialGroup, TuningStore
from mla_tune.machine.fingerprint import DeviceFingerprint
from mla_tune.problem.shapes import Shape
from mla_tune.tuning.owners import owner_id, owner_is_dead
from mla_tune.tuning.sweep import (
    SweepError,
    SweepOptions,
    _pooled_fingerprint,
    run_sweep,
)
from mla_tune.tuning.timing import TimingPolicy

FAST = TimingPolicy(warmup=1, min_runs=3, max_runs=5, budget_s=0.05)


def test_faulty_variants_are_recorded_and_the_winner_is_found(tmp_path):
    register("faulty", "tests.fixtures.fault_backends:FaultBackend")
    store = TuningStore(f"sqlite:///{tmp_path / 't.db'}")
    shape = Shape.uniform(2, 32)
    options = SweepOptions(devices=("cpu", "cpu"), policy=FAST, baselines=False,
                           candidate_timeout_s=4.0)
    results = run_sweep([shape], [get_backend("faulty")], store, options)
    trials = {(t.config["mode"], t.config["delay_ms"]): t for t in store.trials()}
    assert set(trials) == {("ok", 0), ("ok", 3), ("exit", 0), ("segv", 0), ("hang", 0),
                           ("raise", 0)}
    status = {k: t.status for k, t in trials.items()}
    assert status == {("ok", 0): "ok", ("ok", 3): "ok", ("exit", 0): "failed",
                      ("segv", 0): "failed", ("hang", 0): "timeout", ("raise", 0): "failed"}
    assert "exited with code 3" in trials["exit", 0].error
    assert "killed by SIGSEGV" in trials["segv", 0].error
    assert "string_at" in trials["segv", 0].error  # the worker's own fault report
    assert "4 s candidate limit" in trials["hang", 0].error
    assert "faulty kernel launch failed" in trials["raise", 0].error
    assert all(t.worker and t.worker.endswith(":cpu") for t in trials.values())
    winner = results[0].winner
    assert winner is not None and winner.config == {"mode": "ok", "delay_ms": 0}
    assert winner.median_us == trials["ok", 0].median_us < trials["ok", 3].median_us
    group = TrialGroup(winner.device_id, winner.software_id, shape.key, "faulty",
                       winner.source_hash)
    assert store.claims(group) == []  # every claim went with its trial


def test_owner_liveness_is_judged_only_on_this_machine():
    me = owner_id()
    assert not owner_is_dead(me)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = me.rsplit("/", 1)[0] + "/" + done.stdout.strip()
    assert owner_is_dead(dead)
    assert not owner_is_dead("another-host/abcdef12/" + done.stdout.strip())
    assert not owner_is_dead(f"{me.rsplit('/', 1)[0]}/{os.getppid()}")


def test_timings_of_different_gpus_are_not_pooled():
    h200 = DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 132, 150 << 30)
    h100 = DeviceFingerprint("nvidia", "NVIDIA H100 80GB HBM3", "sm_90", 132, 80 << 30)
    assert _pooled_fingerprint([("cuda:0", h200), ("cuda:1", h200)]) == h200
    with pytest.raises(SweepError, match="GPUs differ"):
        _pooled_fingerprint([("cuda:0", h200), ("cuda:1", h100)])
