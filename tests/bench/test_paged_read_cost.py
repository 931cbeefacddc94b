"""bench/paged_read_cost.py --baseline runs each layout with a second version of the kernel
file next to the checkout's: a version with a wrong softmax scale must show its error, the
checkout's must not (under Triton's interpreter, so the times are nan and only the wiring
is checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_baseline_runs_its_own_kernel_file(tmp_path: Path) -> None:
    text = (ROOT / "kernels/triton/mla_decode.py").read_text()
    assert "LOG2E = 1.4426950408889634" in text
    wrong = tmp_path / "wrong_scale.py"
    wrong.write_text(text.replace("LOG2E = 1.4426950408889634", "LOG2E = 2.0"))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "bench/paged_read_cost.py", "--baseline", str(wrong),
         "--batch", "2", "--format", "bf16", "--pages", "64", "--steps", "2", "--lo", "30",
         "--hi", "200", "--config", "block_n=32,kv_load=tma", "--programs", "3",
         "--seg-cost", "1", "--layouts",
         "tokens tma,paged 64 shuffled tma,paged 64 shuffled tile"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    errs = {cells[0]: float(cells[2]) for cells in
            (line.strip(" |").split(" | ") for line in proc.stdout.splitlines()
             if line.startswith("| ") and not line.startswith("| layout"))}
    layouts = ("tokens tma", "paged 64 shuffled tma", "paged 64 shuffled tile")
    assert set(errs) == {*layouts, *(f"{x} [baseline]" for x in layouts)}, proc.stdout
    for layout in layouts:
        assert errs[layout] <= 0.02, (layout, proc.stdout)
        assert errs[f"{layout} [baseline]"] > 0.05, (layout, proc.stdout)
