"""Worker-side jobs: warm-up prepares a worker's first shape while kernels compile."""

import torch

from mla_tune.problem.shapes import Shape
from mla_tune.tuning.timing import TimingPolicy
from mla_tune.tuning.workers import WarmupJob, WorkerContext


def test_warm_up_makes_the_first_shapes_input_and_survives_bad_backends():
    ctx = WorkerContext("cpu", TimingPolicy(), seed=0)
    shape = Shape.uniform(2, 16)
    job = WarmupJob(shape.to_json(), ("torch", "no-such-backend"))
    assert ctx.shape_key is None
    assert job.run(ctx) is None
    assert ctx.shape_key == shape.key
    _, ref, _ = ctx.inputs(shape)
    assert ref.shape == (2, 16, 512) and ref.dtype == torch.float32


def test_a_runoff_across_formats_builds_and_checks_each_candidate_in_its_own_format():
    from mla_tune.backends import register
    from mla_tune.tuning.workers import RunoffJob

    register("formatbound", "tests.fixtures.toy_backends:FormatBoundBackend")
    ctx = WorkerContext("cpu", TimingPolicy(warmup=1, min_runs=3, max_runs=3), seed=0)
    shape = Shape.uniform(2, 16)
    cands = tuple(("formatbound", {"kv": f}) for f in ("bf16", "fp8", "mxfp4"))
    together = RunoffJob(shape.to_json(), cands, ("bf16", "fp8", "mxfp4")).run(ctx)
    assert [o.status for o in together] == ["ok", "ok", "ok"]
    assert all(o.stats is not None and o.max_abs_err is not None for o in together)
    # Without the formats every candidate is built for the job's own shape (bf16).
    alone = RunoffJob(shape.to_json(), cands).run(ctx)
    assert [o.status for o in alone] == ["ok", "failed", "failed"]


def test_a_trial_job_checks_the_shapes_probe_batches():
    from mla_tune.backends import register
    from mla_tune.tuning.workers import TrialJob

    register("taildrop", "tests.fixtures.toy_backends:TailDroppingBackend")
    ctx = WorkerContext("cpu", TimingPolicy(warmup=1, min_runs=3, max_runs=3), seed=0)
    shape = Shape.uniform(2, 128)
    probe = ctx.probes(shape)[0]
    assert probe.shape.kv_lens == (91, 128, 21) and probe.ref.shape == (3, 16, 512)
    out = TrialJob(shape.to_json(), "taildrop", {"delay_ms": 0, "mode": "ok"}).run(ctx)
    assert out.status == "wrong" and "probe batch" in out.error


def test_a_q_len_1_variant_is_also_checked_at_q_len_4():
    from mla_tune.backends import register
    from mla_tune.tuning.workers import TrialJob

    register("causalblind", "tests.fixtures.toy_backends:CausalBlindBackend")
    ctx = WorkerContext("cpu", TimingPolicy(warmup=1, min_runs=3, max_runs=3), seed=0)
    shape = Shape.uniform(2, 128)
    assert [p.shape.q_len for p in ctx.probes(shape)] == [1, 4]
    out = TrialJob(shape.to_json(), "causalblind", {"delay_ms": 0, "mode": "ok"}).run(ctx)
    assert out.status == "wrong" and "probe batch (q_len 4," in out.error
    # The same kernel is right on the q_len-1 shape itself.
    data, ref, tol = ctx.inputs(shape)
    from mla_tune.problem.verify import check
    from tests.fixtures.toy_backends import CausalBlindBackend
    assert check(CausalBlindBackend().build(shape, {}, ctx.device)(data), ref, tol).ok
