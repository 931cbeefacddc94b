"""The CLI's own surface: version, option ranges, and help text that the terminal wraps."""

from __future__ import annotations

from typer.testing import CliRunner

from mla_tune import __version__
from mla_tune.cli.main import app

runner = CliRunner()


def test_version_prints_the_package_version() -> None:
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"mla-tune {__version__}"


def test_heads_outside_1_to_128_is_refused_with_exit_2() -> None:
    for bad in ("0", "129"):
        r = runner.invoke(app, ["sweep", "--shape", "4x64", "--heads", bad, "--dry-run",
                                "--device", "cpu"])
        assert r.exit_code == 2, r.output
    ok = runner.invoke(app, ["sweep", "--shape", "4x64", "--heads", "7", "--dry-run",
                             "--device", "cpu", "-f", "bf16", "-b", "torch"])
    assert ok.exit_code == 0, ok.output
    assert "h7" in ok.output


def test_help_paragraphs_are_not_broken_where_the_source_breaks_lines() -> None:
    r = runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "so a crashing or hanging variant is recorded and the sweep goes on" in r.output


def test_readme_diff_examples_between_stacks_run_on_the_db_they_name() -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    examples = re.findall(r"^mla-tune diff ([0-9a-f]{4,64}) ([0-9a-f]{4,64}) --db (\S+)",
                          readme, re.M)
    assert examples, "the README shows a diff between two software stacks"
    for before, after, db in examples:
        r = runner.invoke(app, ["diff", before, after, "--db", db])
        assert r.exit_code == 0, r.output
