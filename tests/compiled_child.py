"""Child Python processes that compile Triton kernels for real: tests that cross-compile run
them there, since kernels defined while TRITON_INTERPRET is set stay interpreted for the
life of a process, whatever the test process itself has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_compiled(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`python ARGS` from the project root, without TRITON_INTERPRET and with the project
    importable; output captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def interpreted_rows(script: str | Path, timeout: float) -> dict[str, dict]:
    """Run `script` in a child Python under the Triton interpreter (TRITON_INTERPRET=1 must
    be set before kernels are defined) and return the JSON lines it prints, by "name"."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["name"]: r for r in rows}
