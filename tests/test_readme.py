"""The README's two commands are the project's contract with a new machine and with CI."""

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_opens_with_run_and_test_commands():
    run, test = _commands()[:2]
    assert "mla-tune sweep" in run and "pip install" in run
    assert "pytest" in test and "pip install" in test


def test_ci_runs_exactly_the_readme_test_command():
    test = _commands()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci_lines


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to read a checkout's status")
def test_main_job_leaves_a_checkout_clean_and_the_shipped_results_untouched(tmp_path):
    """The README's first command in a checkout writes only the user's own ./tuning.db, which
    the project's .gitignore ignores, never the shipped results (a small shape and one
    backend here, to keep it fast)."""
    shipped = ROOT / "mla_tune" / "shipped" / "tuning.db"
    before = hashlib.sha256(shipped.read_bytes()).hexdigest()
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(ROOT / ".gitignore", checkout / ".gitignore")
    env = {k: v for k, v in os.environ.items() if k != "MLA_TUNE_DB"}
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True, env=env)
    run = _commands()[0].split("&&")
    assert [c.strip() for c in run[1:]] == ["mla-tune sweep --shape 4x1024", "mla-tune report"]
    for args in (["sweep", "--shape", "2x64", "-f", "bf16", "--backend", "torch",
                  "--no-baseline", "--runoff", "0", "--time-budget", "0.01", "--device", "cpu"],
                 ["report"]):
        r = subprocess.run([sys.executable, "-m", "mla_tune", *args], cwd=checkout, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    assert (checkout / "tuning.db").is_file()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                            cwd=checkout, env=env, capture_output=True, text=True, check=True)
    assert status.stdout.splitlines() == ["?? .gitignore"]
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() == before
