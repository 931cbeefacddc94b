"""Every compiled variant of the Triton family's default space builds for NVIDIA sm_90 and
AMD gfx950 through Triton's cross-compilation (no GPU needed), and the precheck reports any
that spill registers or overflow shared memory instead of letting them reach a GPU.

The compiles run in a child process (`python -m kernels.triton.static_check`, two workers):
Triton kernels must be defined without TRITON_INTERPRET, whatever other tests do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "kernels.triton.static_check"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    return rows


def test_default_space_is_compact() -> None:
    from kernels.triton import static_check

    assert 0 < len(static_check.default_variants()) <= 24


def test_every_variant_compiles_for_both_targets(reports: list[dict]) -> None:
    from kernels.triton import static_check

    failed = [(r["config"], r["report"]["error"]) for r in reports if not r["report"]["ok"]]
    assert not failed, failed[:3]
    assert len(reports) == 2 * len(static_check.default_variants())
    assert {r["report"]["target"] for r in reports} == {"cuda:90", "hip:gfx950"}


def test_resources_are_recorded_and_problems_reported(reports: list[dict]) -> None:
    from kernels.triton.static_check import SHARED_LIMIT, CompileReport

    for row in reports:
        rep = CompileReport(**row["report"])
        assert rep.registers > 0 and rep.shared > 0, row
        if rep.spills or rep.shared > SHARED_LIMIT[rep.target]:
            assert rep.problem(), row  # the sweep will skip it before using the GPU
        else:
            assert rep.problem() is None, row


def test_measured_best_variant_is_clean(reports: list[dict]) -> None:
    """The variant the H200 measurements favour must not be pruned on either target."""
    from kernels.triton.static_check import CompileReport

    good = [CompileReport(**r["report"]) for r in reports
            if (r["config"]["kv_format"], r["config"]["compute"], r["config"]["block_n"],
                r["config"]["num_stages"]) == ("bf16", "bf16", 32, 3)]
    assert len(good) == 2 and all(g.problem() is None for g in good), good
