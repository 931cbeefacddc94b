"""Child Python processes that compile Triton kernels for real: tests that cross-compile run
them there, since kernels defined while TRITON_INTERPRET is set stay interpreted for the
life of a process, whatever the test process itself has."""

from __future__ import annotations

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
