"""The sweep's plan (usable backends, candidates per shape) and its worker devices: what
`sweep --dry-run` lists is what the sweep measures."""

from __future__ import annotations

import pytest
import torch

from mla_tune.backends import get_backend
from mla_tune.problem.shapes import Shape
from mla_tune.tuning.devices import DeviceChoiceError, sweep_devices
from mla_tune.tuning.plan import plan_sweep, shape_candidates


def test_the_plan_counts_what_each_backend_offers_and_says_why_others_are_out() -> None:
    cpu = torch.device("cpu")
    torch_family, flashinfer = get_backend("torch"), get_backend("flashinfer")
    shapes = [Shape.uniform(2, 64), Shape.uniform(4, 256, kv_format="fp8")]
    plan = plan_sweep(shapes, [torch_family, flashinfer], cpu, {})
    assert plan.backends == ("torch", "flashinfer")
    assert "flashinfer" in plan.skipped and "torch" not in plan.skipped
    want = [len(torch_family.candidates(s, cpu, None)) for s in shapes]
    assert [counts for _, counts in plan.rows] == [(n, None) for n in want]
    assert plan.total == sum(want) > 0
    pinned = plan_sweep(shapes[:1], [torch_family], cpu, {"torch": {"num_splits": [1]}})
    assert 0 < pinned.total < want[0]
    assert shape_candidates(torch_family, shapes[0], cpu, {"torch": {"num_splits": [1]}}) \
        == torch_family.candidates(shapes[0], cpu, {"num_splits": [1]})


@pytest.mark.parametrize("device, gpus, message", [
    ("tpu", None, "unknown device 'tpu'"),
    ("cpu", "2", "--gpus needs --device cuda"),
])
def test_bad_device_choices_say_what_to_do(device: str, gpus: str | None, message: str) -> None:
    with pytest.raises(DeviceChoiceError, match=message):
        sweep_devices(device, gpus)


def test_a_cpu_sweep_runs_one_worker() -> None:
    assert sweep_devices("cpu", None) == ("cpu",)
