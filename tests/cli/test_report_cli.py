"""`mla-tune report` in the terminal: a table that fits 80 columns, shapes named as the CLI
names them, baselines and geomeans that say what they count, a flagged read ceiling, stored
text printed as text, and damaged rows skipped by name (or a damaged file refused)."""

import dataclasses
import io
import json
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mla_tune.cli.main import app
from mla_tune.cli.report import _print_report
from mla_tune.db import TrialGroup, TrialResult, TuningStore, shipped_db_path
from mla_tune.reports.table import DEFAULT_COLUMNS, report_rows, suite_summaries, summary_lines
from tests.db.faults import overwrite_pages
from tests.fixtures.sweep_db import SHAPES, swept_db

runner = CliRunner()
# The width CLI runs are rendered at, set explicitly: tests never read the terminal's.
ENV = {"COLUMNS": "80"}


@pytest.fixture()
def db(tmp_path: Path) -> str:
    swept_db(tmp_path / "t.db").close()
    return str(tmp_path / "t.db")


def _sql(path: str, statement: str, *args: object) -> None:
    with closing(sqlite3.connect(path)) as con, con:
        con.execute(statement, args)


def _winner_ids(path: str) -> dict[str, int]:
    with closing(sqlite3.connect(path)) as con:
        return dict(con.execute("SELECT shape_key, id FROM mt_winners").fetchall())


def _render(rows, width: int, columns=DEFAULT_COLUMNS, configs=False) -> list[str]:
    buf = io.StringIO()
    _print_report(rows, None, list(columns), configs, Console(file=buf, width=width))
    return buf.getvalue().splitlines()


def test_table_fits_80_columns_one_line_per_winner_on_the_shipped_db():
    """84 winners: at 80 columns the old table took 4,942 lines (configs wrapped a few
    characters a line); the compact one takes a line per winner, at any terminal width."""
    with TuningStore(str(shipped_db_path()), read_only=True) as store:
        rows = report_rows(store)
    assert len(rows) > 40
    lines = _render(rows, 80)
    assert max(len(line) for line in lines) <= 80
    assert len(lines) < len(rows) + 60
    def triton_rows(lines: list[str]) -> list[str]:
        # Notes under the table may name triton too: rows start with their shape.
        return [line for line in lines if line[:1] == " " and line[1:2].isdigit()
                and " triton" in line]

    assert len(triton_rows(lines)) == sum(r.backend == "triton" for r in rows)
    # On a wide terminal the table keeps its width (notes wrap at the terminal's).
    assert max(len(line) for line in triton_rows(_render(rows, 200))) <= 80


def test_configs_and_columns_options(db):
    r = runner.invoke(app, ["report", "--db", db, "--columns", "shape,winner,trials",
                            "--configs"], env=ENV)
    assert r.exit_code == 0, r.output
    assert "trials" in r.stdout and "GB/s" not in r.stdout
    assert "num_splits=" in r.stdout  # the configs listing under the table
    r = runner.invoke(app, ["report", "--db", db, "--columns", "shape,nope"], env=ENV)
    assert r.exit_code == 2 and "unknown column 'nope'" in r.output and "vs_torch" in r.output


def test_markdown_format(db):
    r = runner.invoke(app, ["report", "--db", db, "--format", "markdown", "--configs"],
                      env=ENV)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("| shape | winner | µs |") and lines[0].endswith("| config |")
    assert lines[1].startswith("|---|---|---:|")
    assert len([line for line in lines if line.startswith("| ") and "torch" in line]) == 2
    assert any(line.startswith("- geometric mean bf16") for line in lines)


def test_hide_superseded(db):
    with TuningStore(db) as store:
        t = store.trials(shape_key=SHAPES[0].key)[0]
        store.record_trial(TrialGroup(t.device_id, t.software_id, t.shape_key, t.backend,
                                      "f" * 16),
                           TrialResult(t.shape_json, t.kv_format, t.config, "ok",
                                       stats={"median_us": 1.0}))
    r = runner.invoke(app, ["report", "--db", db], env=ENV)
    assert r.exit_code == 0 and "torch*" in r.stdout and "* superseded" in r.stdout
    r = runner.invoke(app, ["report", "--db", db, "--hide-superseded"], env=ENV)
    assert r.exit_code == 0 and "no winners match" in r.output


@pytest.mark.parametrize("text", ["2x512", "2x512 bf16", "2x512:bf16", "2x512 bf16 h16 q1",
                                  SHAPES[0].key])
def test_shape_accepts_cli_notation_label_and_key(db, text):
    r = runner.invoke(app, ["report", "--db", db, "--shape", text, "--format", "json"],
                      env=ENV)
    assert r.exit_code == 0, r.output
    keys = {row["shape_key"] for row in json.loads(r.stdout)}
    assert keys == ({SHAPES[0].key} if any(m in text for m in ("bf16", "-h16-"))
                    else {s.key for s in SHAPES})


@pytest.mark.parametrize("text, message", [
    ("nonsense", "bad shape 'nonsense'"), ("4x1024", "no stored winner for shape '4x1024'"),
    ("2x512 mxfp4", "no stored winner"), ("0x0 fp8", "no stored winner"),
    ("2x512 zz", "'zz' is neither a KV format")])
def test_unknown_shape_is_exit_2_listing_what_exists(db, text, message):
    r = runner.invoke(app, ["report", "--db", db, "--shape", text], env=ENV)
    assert r.exit_code == 2 and message in r.output
    if "no stored winner" in message:
        assert "2x512 bf16 h16 q1" in r.output and "2x512 fp8 h16 q1" in r.output


def test_an_unknown_shape_on_a_large_db_names_the_nearest_few_and_counts_the_rest():
    """The shipped DB holds over 200 winners: the error names the closest ten (the ragged
    128-sequence buckets of that format first for '128x4096 fp8'), not the whole DB."""
    r = runner.invoke(app, ["report", "--db", "shipped", "--shape", "128x4096 fp8"], env=ENV)
    message = " ".join(r.output.split())
    assert r.exit_code == 2
    listed = message.split("nearest shapes with winners: ")[1].split(" and ")[0].split(", ")
    assert len(listed) == 10 and listed[0].startswith("128x~") and "fp8" in listed[0]
    assert all(label.startswith("128x") for label in listed)
    assert "more (`mla-tune report` lists them all)" in message


def test_geomeans_count_only_shapes_with_a_baseline_and_say_how_many(db):
    with TuningStore(db, read_only=True) as store:
        rows = report_rows(store)
    rows = [rows[0], dataclasses.replace(rows[1], baseline_backend=None, baseline_us=None,
                                         torch_us=None)]
    (both,) = [s for s in suite_summaries(rows) if s.kv_format == "all"]
    assert (both.shapes, both.with_baseline, both.with_torch) == (2, 1, 1)
    assert both.speedup_vs_baseline == pytest.approx(rows[0].speedup_vs_baseline)
    text = "\n".join(summary_lines(rows, None))
    assert "vs baseline over 1 of 2 shapes" in text
    assert f"baselines timed in stack {rows[0].software_hash[:8]}" in text
    assert "torch at 1 of 2 current winners" in text


def test_a_winner_above_the_stored_ceiling_is_shown_unclamped_and_flagged(db):
    with TuningStore(db) as store:
        store.set_read_bandwidth(store.devices()[0].id, 1e-3)
        rows = report_rows(store)
    assert all(r.above_ceiling and r.pct_of_read_bw > 100 for r in rows)
    text = "\n".join(_render(rows, 80))
    assert f"{rows[0].pct_of_read_bw:.0f}%!" in text
    assert "2 winner(s) read faster than their device's stored read ceiling" in text
    from mla_tune.reports.html import render_html

    with TuningStore(db, read_only=True) as store:
        html = render_html(store, rows)
    assert f"{rows[0].pct_of_read_bw:.1f}% !</span>" in html and "shown unclamped" in html


def test_stored_text_and_arguments_print_as_text_not_markup_or_emoji(db):
    name = "GPU [red]x[/red] :x: [bold]"
    _sql(db, "UPDATE mt_devices SET name = ?", name)
    r = runner.invoke(app, ["report", "--db", db], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert name in r.stdout and "❌" not in r.stdout
    r = runner.invoke(app, ["report", "--db", db, "--suite", ":x: [b]y[/b]"], env=ENV)
    assert r.exit_code == 2 and ":x: [b]y[/b]" in r.output and "❌" not in r.output


HUGE = "1" * 5001
# (table, column, value): each makes the bf16 winner's row (or its device / stack) one no
# winner can hold.
MALFORMED = [
    ("mt_winners", "config_json", "null"), ("mt_winners", "config_json", ""),
    ("mt_winners", "config_json", b"\x00\xff\xfe"), ("mt_winners", "config_json", "[1, 2]"),
    ("mt_winners", "config_json", '{"a": ' * 20000 + "1" + "}" * 20000),
    ("mt_winners", "config_json", '{"num_splits": ' + HUGE + "}"),
    ("mt_winners", "config_json", json.dumps({"x": "y" * (2 * 2**20)})),
    ("mt_winners", "config_json", json.dumps({f"k{i}": i for i in range(100)})),
    ("mt_winners", "median_us", 0), ("mt_winners", "median_us", "fast"),
    ("mt_winners", "shape_json", '{"batch": 0, "kv_lens": 512, "q_len": 1, "heads": 16, '
                                 '"kv_format": "bf16", "page_size": 1}'),
    ("mt_winners", "shape_json", '{"batch": 1099511627776, "kv_lens": 512, "q_len": 1, '
                                 '"heads": 16, "kv_format": "bf16", "page_size": 1}'),
    ("mt_winners", "shape_json", '{"batch": 134217728, "kv_lens": 512, "q_len": 1, '
                                 '"heads": 16, "kv_format": "bf16", "page_size": 1}'),
    ("mt_winners", "backend", ""), ("mt_winners", "trial_id", "x"),
]


@pytest.mark.parametrize("table, column, value", MALFORMED,
                         ids=[f"{c}={str(v)[:20]!r}" for _, c, v in MALFORMED])
def test_a_malformed_winner_is_skipped_with_a_warning_naming_it(db, table, column, value):
    wid = _winner_ids(db)[SHAPES[0].key]
    _sql(db, f"UPDATE {table} SET {column} = ? WHERE id = ?", value, wid)
    r = runner.invoke(app, ["report", "--db", db, "--format", "json"], env=ENV)
    assert r.exit_code == 0, r.output
    assert [row["shape_key"] for row in json.loads(r.stdout)] == [SHAPES[1].key]
    assert f"warning: skipped winner {wid} ({SHAPES[0].key})" in r.stderr
    r = runner.invoke(app, ["report", "--db", db], env=ENV)
    assert r.exit_code == 0 and "2x512 fp8 h16 q1" in r.stdout


@pytest.mark.parametrize("statement", [
    "UPDATE mt_software SET versions_json = 'garbage'",
    "UPDATE mt_software SET versions_json = '[1]'",
    "UPDATE mt_devices SET name = ''", "UPDATE mt_devices SET vendor = 'evil'",
    "UPDATE mt_devices SET sm_count = 'many'"])
def test_bad_device_or_software_rows_skip_their_winners_by_name(db, statement):
    _sql(db, statement)
    r = runner.invoke(app, ["report", "--db", db], env=ENV)
    assert r.exit_code == 0, r.output
    assert r.stderr.count("warning: skipped winner") == 2
    assert "no winners stored yet" in r.output


def test_bad_read_bandwidth_reads_as_not_measured(db):
    _sql(db, "UPDATE mt_devices SET read_bw_gbps = 'fast'")
    r = runner.invoke(app, ["report", "--db", db, "--format", "json"], env=ENV)
    assert r.exit_code == 0, r.output
    assert [row["pct_of_read_bw"] for row in json.loads(r.stdout)] == [None, None]


@pytest.mark.parametrize("value", ["null", "slow", 0, -1.0])
def test_a_malformed_trial_is_skipped_with_a_warning_naming_it(db, value):
    with closing(sqlite3.connect(db)) as con:
        (tid,) = con.execute("SELECT id FROM mt_trials WHERE status = 'ok' AND id NOT IN "
                             "(SELECT trial_id FROM mt_winners) LIMIT 1").fetchone()
    column = "config_json" if value == "null" else "median_us"
    _sql(db, f"UPDATE mt_trials SET {column} = ? WHERE id = ?", value, tid)
    r = runner.invoke(app, ["report", "--db", db, "--format", "json"], env=ENV)
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)) == 2
    assert f"warning: skipped trial {tid} (" in r.stderr


@pytest.mark.parametrize("damage, message", [
    (lambda p: overwrite_pages(Path(p), 3, count=20), "damaged"),
    (lambda p: _sql(p, "DROP TABLE mt_winners"), "cannot read the tuning DB"),
    (lambda p: _sql(p, "UPDATE mt_winners SET updated_at = 'yesterday'"),
     "holds a row of its winners that cannot be read")])
def test_a_damaged_file_is_exit_2_with_a_message_not_a_traceback(db, damage, message):
    with closing(sqlite3.connect(db)) as con:  # everything in the main file, none in -wal
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    damage(db)
    r = runner.invoke(app, ["report", "--db", db], env=ENV)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_every_cli_console_prints_text_as_it_is():
    """Tables and messages of every command (report, diff, sweep, route) go through these
    consoles: markup and :emoji: codes in what they print stay as typed."""
    from rich.table import Table

    from mla_tune.cli import main as cli
    from mla_tune.cli import route as route_cli

    text = "[red]x[/red] :x: [bold]"
    for con in (cli.out, cli.console, route_cli._out):
        table = Table()
        table.add_column("cell")
        table.add_row(text)
        with con.capture() as captured:
            con.print(f"message {text}")
            con.print(table)
        assert captured.get().count(text) == 2
