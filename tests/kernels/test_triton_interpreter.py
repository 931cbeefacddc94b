"""Correctness of every format and feature of the Triton family on CPU through the Triton
interpreter, against the float32 reference. All cases run in one child process (see
_interp_cases.py for why), once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton")

from tests.kernels._interp_cases import CASES  # noqa: E402  (imports no Triton kernels)

HERE = Path(__file__).resolve().parent

# Max abs error allowed per case family (outputs are O(0.1-1)): converted paths round P to
# bf16/fp16 only; the fp8 MMA path also rounds Q and P to e4m3 (leaderboard-style a8w8).
BOUNDS = {"bf16": 0.02, "fp8_bf16": 0.02, "fp8_fp16": 0.02, "fp8_fp8qk": 0.05, "fp8_fp8": 0.08,
          "mxfp4": 0.02}
MISMATCH = {"fp8_fp8qk": 0.15, "fp8_fp8": 0.25}
"""Share of elements allowed outside 1e-2 + 1e-2*|ref|: the e4m3 Q/P path is judged like
aiter's a8w8 kernel, by max error, not elementwise 1e-2."""


def _family(name: str) -> str:
    for key in ("fp8_bf16", "fp8_fp16", "fp8_fp8qk", "fp8_fp8", "mxfp4", "bf16"):
        if name.startswith(key):
            return key
    raise KeyError(name)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    from tests.compiled_child import interpreted_rows

    return interpreted_rows(HERE / "_interp_cases.py", timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_case_matches_reference(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert r["shape"] == r["ref_shape"]
    assert r["finite"]
    fam = _family(name)
    assert r["max_abs_err"] <= BOUNDS[fam], r
    assert r["mismatch_1e-2"] <= MISMATCH.get(fam, 0.0), r



def test_tma_cases_run_the_descriptors_their_knob_names(results: dict[str, dict]) -> None:
    # The nan-tail cases above check isolation in both modes only if each ran its own mode.
    from mla_tune.kernels.triton.mla_decode import TMA_HOST_DESC, TMA_KERNEL_DESC

    modes = {name: (r["tma"], CASES[name][1]["kv_load"]) for name, r in results.items()
             if "_tma_" in name}
    assert {knob for _, knob in modes.values()} == {"tma", "tma_host"}
    for name, (mode, knob) in modes.items():
        assert mode == (TMA_HOST_DESC if knob == "tma_host" else TMA_KERNEL_DESC), name
