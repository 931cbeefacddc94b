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
