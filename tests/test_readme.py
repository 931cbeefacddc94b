"""The README's two commands are the project's contract with a new machine and with CI."""

import re
from pathlib import Path

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
