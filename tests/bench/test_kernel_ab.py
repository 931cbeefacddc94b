"""bench/kernel_ab.py runs each kernel version from its own copy of the checkout: a version
with a wrong softmax scale must show its error, the unchanged one must not (under Triton's
interpreter, so the times are nan and only the wiring is checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_each_version_runs_its_own_kernel_file(tmp_path: Path) -> None:
    kernel = ROOT / "kernels/triton/mla_decode.py"
    text = kernel.read_text()
    assert "LOG2E = 1.4426950408889634" in text
    wrong = tmp_path / "wrong_scale.py"
    wrong.write_text(text.replace("LOG2E = 1.4426950408889634", "LOG2E = 2.0"))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "bench/kernel_ab.py", f"same={kernel}", f"wrong={wrong}",
         "--rounds", "1", "--",
         "--batch", "2", "--format", "bf16", "--pages", "64", "--steps", "2", "--lo", "30",
         "--hi", "200", "--config", "block_n=32,kv_load=tma", "--programs", "3",
         "--seg-cost", "1", "--layouts", "tokens tma,paged 64 shuffled tma"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): line.strip(" |").split(" | ")[1:]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "round" not in line}
    assert set(rows) == {"tokens tma", "paged 64 shuffled tma"}, proc.stdout
    for layout, (same, wrong_cell) in rows.items():
        same_err = float(same.split(" / ")[1])
        wrong_err = float(wrong_cell.split(" / ")[1])
        assert same_err <= 0.02, (layout, proc.stdout)
        assert wrong_err > 0.05, (layout, proc.stdout)
