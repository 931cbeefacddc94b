"""Side-by-side evaluation: each candidate is built and verified alone, then only the
correct ones are timed, one call each per round."""

import torch

from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import Shape, generate_input
from mla_tune.problem.verify import tolerance_for
from mla_tune.tuning.evaluate import evaluate_side_by_side
from mla_tune.tuning.timing import TimingPolicy, WallTimer
from tests.fixtures.toy_backends import ToyBackend


def test_side_by_side_times_only_correct_candidates_in_order():
    shape = Shape.uniform(2, 8)
    data = generate_input(shape, seed=0, device="cpu")
    ref = mla_decode_reference(*data, kv_format="bf16")
    toy = ToyBackend()
    configs = [{"delay_ms": 4, "mode": "ok"}, {"delay_ms": 0, "mode": "wrong"},
               {"delay_ms": 0, "mode": "raise"}, {"delay_ms": 0, "mode": "ok"}]
    timer = WallTimer(TimingPolicy(warmup=1, min_runs=5, max_runs=5, budget_s=5.0))
    out = evaluate_side_by_side([(toy, c) for c in configs], shape, torch.device("cpu"), data,
                                ref, tolerance_for(shape.kv_format), timer)
    assert [o.status for o in out] == ["ok", "wrong", "failed", "ok"]
    assert "toy variant failed to compile" in out[2].error
    assert out[1].stats is None and out[2].stats is None and out[1].max_abs_err > 0
    assert out[0].stats.n == out[3].stats.n >= 5
    assert out[0].stats.median_us > 4000 > out[3].stats.median_us
