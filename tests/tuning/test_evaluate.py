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


def test_a_variant_right_on_the_shape_but_wrong_on_a_ragged_probe_is_not_timed():
    from mla_tune.problem.probes import probe_shapes
    from mla_tune.tuning.evaluate import Probe, evaluate
    from tests.fixtures.toy_backends import TailDroppingBackend

    shape = Shape.uniform(2, 128)
    data = generate_input(shape, seed=0, device="cpu")
    ref = mla_decode_reference(*data, kv_format="bf16")
    probes = []
    for p in probe_shapes(shape):
        p_data = generate_input(p, seed=0, device="cpu")
        probes.append(Probe(p, p_data, mla_decode_reference(*p_data, kv_format="bf16")))
    timer = WallTimer(TimingPolicy(warmup=1, min_runs=3, max_runs=3, budget_s=5.0))
    tol, cpu = tolerance_for(shape.kv_format), torch.device("cpu")
    cfg = {"delay_ms": 0, "mode": "ok"}
    # Every length of the shape is a multiple of 64: the dropped tail never shows there.
    assert evaluate(TailDroppingBackend(), shape, cfg, cpu, data, ref, tol, timer).status == "ok"
    caught = evaluate(TailDroppingBackend(), shape, cfg, cpu, data, ref, tol, timer, probes)
    assert caught.status == "wrong" and caught.stats is None
    assert "probe batch (q_len 1, kv lengths 91, 128, 21)" in caught.error
    right = evaluate(ToyBackend(), shape, cfg, cpu, data, ref, tol, timer, probes)
    assert right.status == "ok" and right.stats is not None


def test_a_variant_that_crashes_on_a_probe_fails_naming_the_probe():
    from mla_tune.problem.probes import probe_shapes
    from mla_tune.tuning.evaluate import Probe, evaluate

    class ShapeBound(ToyBackend):
        """Builds for its tuned shape only: any other batch raises, as a kernel whose
        launch was hard-wired to one shape would."""

        def build(self, shape, config, device):
            if shape.is_ragged:
                raise RuntimeError("grid built for 2 sequences")
            return super().build(shape, config, device)

    shape = Shape.uniform(2, 128)
    data = generate_input(shape, seed=0, device="cpu")
    ref = mla_decode_reference(*data, kv_format="bf16")
    (p, _) = probe_shapes(shape)
    p_data = generate_input(p, seed=0, device="cpu")
    probe = Probe(p, p_data, mla_decode_reference(*p_data, kv_format="bf16"))
    timer = WallTimer(TimingPolicy(warmup=1, min_runs=3, max_runs=3, budget_s=5.0))
    out = evaluate(ShapeBound(), shape, {"delay_ms": 0, "mode": "ok"}, torch.device("cpu"),
                   data, ref, tolerance_for(shape.kv_format), timer, [probe])
    assert out.status == "failed" and out.stats is None
    assert "on the ragged probe batch (q_len 1, kv lengths 91, 128, 21)" in out.error
    assert "grid built for 2 sequences" in out.error
