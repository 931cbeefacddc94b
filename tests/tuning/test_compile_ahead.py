"""The sweep's compile stage: each distinct kernel compiled once, in CPU processes, before
the GPU workers time candidates; a compile that crashes is left to the workers."""

import os
import platform

import torch

from mla_tune.backends import get_backend, register
from mla_tune.db import TuningStore
from mla_tune.problem.shapes import Shape
from mla_tune.tuning.compile_ahead import default_processes, plan_compiles
from mla_tune.tuning.sweep import SweepOptions, run_sweep
from mla_tune.tuning.timing import TimingPolicy
from tests.fixtures.compile_backends import CRASHING_BLOCK, MARKER_DIR_ENV

FAST = TimingPolicy(warmup=1, min_runs=3, max_runs=5, budget_s=0.05)


def _backend():
    register("compiled", "tests.fixtures.compile_backends:CompiledBackend")
    return get_backend("compiled")


def test_plan_has_one_task_per_distinct_kernel_in_shape_order():
    backend = _backend()
    shapes = [Shape.uniform(1, 16), Shape.uniform(2, 16)]
    tasks = plan_compiles(shapes, [backend], torch.device("cpu"))
    # 2 shapes x 3 blocks x 2 unrolls = 12 candidates, 3 kernels (the key ignores the shape).
    assert [(t.shape.key, t.config["block"]) for t in tasks] == [
        (shapes[0].key, 1), (shapes[0].key, 2), (shapes[0].key, 3)]
    pinned = plan_compiles(shapes, [backend], torch.device("cpu"),
                           {"compiled": {"block": [2]}})
    assert [t.config["block"] for t in pinned] == [2]


def test_plan_compiles_the_kernels_of_the_probe_batches_too():
    from tests.fixtures.compile_backends import CompiledBackend

    class PerQLen(CompiledBackend):
        """A family that compiles one kernel per q_len (its row block depends on it)."""

        def compile_key(self, shape, config, device):
            return int(config["block"]), shape.q_len

    shape = Shape.uniform(2, 128)
    tasks = plan_compiles([shape], [PerQLen()], torch.device("cpu"),
                          {"compiled": {"block": [2]}})
    # The shape's kernel, then its q_len-4 probe's (the q_len-1 probe shares the first).
    assert [(t.shape.q_len, t.shape.kv_lens) for t in tasks] == [
        (1, (128, 128)), (4, (91, 128, 21))]


def test_default_processes_leave_cores_to_driver_and_gpu_workers():
    cores = os.cpu_count() or 1
    assert default_processes(1000, 2) == max(1, cores - 3)
    assert default_processes(1, 0) == 1


def test_sweep_compiles_each_kernel_once_before_timing(tmp_path, monkeypatch):
    monkeypatch.setenv(MARKER_DIR_ENV, str(tmp_path))
    backend = _backend()
    seen = []

    class Observer:
        def shape_started(self, *a): ...
        def backend_started(self, *a): ...
        def trial_done(self, *a): ...
        def shape_done(self, *a): ...

        def compile_done(self, summary):
            seen.append(summary)

    store = TuningStore(f"sqlite:///{tmp_path / 't.db'}")
    shapes = [Shape.uniform(1, 16), Shape.uniform(2, 16)]
    run_sweep(shapes, [backend], store,
              SweepOptions(devices=("cpu", "cpu"), policy=FAST, baselines=False), Observer())
    markers = sorted(p.name.split("-")[0] for p in tmp_path.glob("block*"))
    assert markers == ["block1", "block2"]  # once each; block 3's compile process crashed
    arch = platform.machine()
    assert all(f"-{arch}-" in p.name for p in tmp_path.glob("block*"))
    # Compiled in other processes than this one (the compile stage's CPU workers).
    assert all(not p.name.endswith(f"-{os.getpid()}") for p in tmp_path.glob("block*"))
    (summary,) = seen
    assert (summary.kernels, summary.compiled, summary.unfinished) == (3, 2, 0)
    assert len(summary.failed) == 1 and "exited with code 7" in summary.failed[0]
    trials = store.trials()
    assert len(trials) == 12 and {t.status for t in trials} == {"ok"}
    assert {t.config["block"] for t in trials} == {1, 2, CRASHING_BLOCK}


def test_no_compile_ahead_leaves_compiling_to_the_workers(tmp_path, monkeypatch):
    monkeypatch.setenv(MARKER_DIR_ENV, str(tmp_path))
    store = TuningStore(f"sqlite:///{tmp_path / 't.db'}")
    run_sweep([Shape.uniform(1, 16)], [_backend()], store,
              SweepOptions(policy=FAST, baselines=False, compile_ahead=False,
                           pins={"compiled": {"block": [1, 3]}}))
    statuses = {(t.config["block"], t.status) for t in store.trials()}
    assert statuses == {(1, "failed"), (3, "ok")}
    assert "block 1 was not compiled ahead" in next(
        t.error for t in store.trials() if t.config["block"] == 1)


def test_a_gpu_sweeps_stage_starts_its_processes_before_planning(tmp_path, monkeypatch):
    """With GPU workers the compile processes start at once (before planning); the stage
    still compiles each kernel once and reports the crashed compile."""
    from mla_tune.tuning.compile_ahead import CompileStage

    monkeypatch.setenv(MARKER_DIR_ENV, str(tmp_path))
    backend = _backend()
    paths = {"compiled": "tests.fixtures.compile_backends:CompiledBackend"}
    stage = CompileStage([Shape.uniform(1, 16)], [backend], torch.device("cpu"), {}, paths,
                         gpu_workers=1, job_limit_s=60)
    stage.start()
    assert stage._pool is not None and stage._pool.size >= 1  # launched before planning
    summary = stage.join()
    assert (summary.kernels, summary.compiled, len(summary.failed)) == (3, 2, 1)
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("block*")) == ["block1", "block2"]


def test_a_stage_without_compiling_backends_starts_no_process():
    from mla_tune.tuning.compile_ahead import CompileStage

    register("toy", "tests.fixtures.toy_backends:ToyBackend")
    stage = CompileStage([Shape.uniform(1, 16)], [get_backend("toy")], torch.device("cpu"),
                         {}, {"toy": "tests.fixtures.toy_backends:ToyBackend"},
                         gpu_workers=2, job_limit_s=60)
    stage.start()
    assert stage._pool is None
    summary = stage.join()
    assert (summary.kernels, summary.compiled, summary.processes) == (0, 0, 0)
