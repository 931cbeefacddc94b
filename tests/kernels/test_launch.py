"""The Triton family's launch rules (kernels/triton/launch.py): a ragged shape is built as its
length bucket's runner (the balanced schedule, with the config's seg_cost; paged shapes
through a page pool copied once from the task's contiguous cache), a uniform one as
per-sequence splits; both against the float32 reference, through the Triton interpreter in
a child process (this file run as a script)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytest.importorskip("triton")

CONFIG = {"block_m": 16, "block_n": 32, "compute": "bf16", "fast_mode": False,
          "fp8_convert": "staged", "kv_load": "pointer", "num_splits": 2, "num_stages": 2,
          "num_warps": 4, "page_size": 1, "pdl": True}
"""A CPU-space point without seg_cost (as stored before the knob); cases add theirs."""

# name: (format, lengths, q_len, page size, config changes)
CASES: dict[str, tuple[str, tuple[int, ...], int, int, dict[str, Any]]] = {
    "ragged_bf16_seg4": ("bf16", (37, 100, 70), 1, 1, {"seg_cost": 4}),
    "ragged_fp8_q2_fused": ("fp8", (60, 33, 90), 2, 1,
                            {"compute": "fp8", "fast_mode": True, "seg_cost": 2}),
    "ragged_mxfp4_p16_seg8": ("mxfp4", (37, 100, 70), 1, 16, {"seg_cost": 8}),
    "ragged_fp8_p64_default": ("fp8", (150, 41, 70), 1, 64, {"compute": "fp16"}),
    "uniform_bf16": ("bf16", (64, 64), 1, 1, {}),
}


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    from tests.compiled_child import interpreted_rows

    return interpreted_rows(__file__, timeout=600)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("ragged")])
def test_a_ragged_build_is_its_buckets_balanced_runner(results: dict[str, dict],
                                                       name: str) -> None:
    fmt, _, _, page, change = CASES[name]
    r = results[name]
    assert r["launcher"] == "BalancedLauncher", r
    assert r["sched"] == ("paged" if page > 1 else "tokens"), r
    assert r["seg_cost"] == change.get("seg_cost", 1), r  # stored without it: the default
    assert r["err"] <= (0.08 if change.get("compute") == "fp8" else 0.02), (fmt, r)


def test_a_uniform_build_keeps_per_sequence_splits(results: dict[str, dict]) -> None:
    r = results["uniform_bf16"]
    assert r["launcher"] == "MlaDecodeLauncher" and r["err"] <= 0.02, r


def test_the_page_pool_is_copied_once_and_again_after_a_write(results: dict[str, dict]
                                                              ) -> None:
    r = results["pool_reuse"]
    assert r["same_pool_same_tensors"], r
    assert r["new_pool_after_write"] and r["err_after_write"] <= 0.02, r


def test_the_bucket_runner_takes_other_lengths_of_its_batch(results: dict[str, dict]
                                                            ) -> None:
    r = results["other_lengths"]
    assert r["err"] <= 0.02, r


# -- the interpreter child ---------------------------------------------------------------


def _child() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    import torch

    from mla_tune.kernels.triton.launch import build_variant
    from mla_tune.kernels.triton.mla_decode import SCHED_PAGED, SCHED_TOKENS
    from mla_tune.problem.reference import mla_decode_reference
    from mla_tune.problem.shapes import Shape, generate_input

    def err(out: torch.Tensor, data: tuple, fmt: str) -> float:
        return float((out.float() - mla_decode_reference(*data, kv_format=fmt)).abs().max())

    runs = {}
    for name, (fmt, lens, q_len, page, change) in CASES.items():
        data = generate_input(Shape(len(lens), lens, q_len=q_len), seed=3)
        run = build_variant(fmt, list(lens), q_len, 16, {**CONFIG, **change},
                            torch.device("cpu"), page_size=page)
        launcher = run.launcher
        print(json.dumps({
            "name": name, "err": err(run(data), data, fmt),
            "launcher": type(launcher).__name__,
            "sched": {SCHED_TOKENS: "tokens", SCHED_PAGED: "paged"}.get(
                getattr(launcher, "sched", None)),
            "seg_cost": getattr(launcher, "seg_cost", None)}), flush=True)
        runs[name] = (run, data)
    run, data = runs["ragged_mxfp4_p16_seg8"]
    first = run.pool()
    run(data)
    same = run.pool() is first
    packed, scales = data[1]["mxfp4"]
    packed.view(torch.uint8)[:40] = packed.view(torch.uint8)[40:80].clone()  # in place
    out = run(data)
    print(json.dumps({"name": "pool_reuse", "same_pool_same_tensors": same,
                      "new_pool_after_write": run.pool() is not first,
                      "err_after_write": err(out, data, "mxfp4")}), flush=True)
    run, _ = runs["ragged_bf16_seg4"]
    other = generate_input(Shape(3, (90, 12, 120)), seed=5)  # the same launcher, no rebuild
    print(json.dumps({"name": "other_lengths", "err": err(run(other), other, "bf16")}),
          flush=True)


if __name__ == "__main__":
    _child()
