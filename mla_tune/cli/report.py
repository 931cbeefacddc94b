"""`mla-tune report`: the winners table (or markdown, JSON, CSV), HTML and PNG charts."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mla_tune.cli.common import DB_HELP, app, console, fail, open_store, out, warn
from mla_tune.problem.shapes import Shape

NEAREST_LISTED = 10  # shapes an unknown --shape error names, closest first


@app.command()
def report(
    db: str | None = typer.Option(None, help=DB_HELP),
    shape: str | None = typer.Option(None, help="Only this shape: BATCHxKV (e.g. 4x1024), "
                                     "optionally with a KV format, hN or qN after it (e.g. "
                                     "'4x1024 fp8'), a label as the table prints it, or a "
                                     "shape key (see `report --format json`)."),
    fmt: str = typer.Option("table", "--format", help="table, markdown, json or csv."),
    suite: str | None = typer.Option(None, help="Only this suite's shapes (in any KV format); "
                                     "geomeans then count the suite's shapes still missing."),
    software: str | None = typer.Option(None, help="Only this software stack (hash prefix)."),
    columns: str | None = typer.Option(None, "--columns", help="Table columns, comma-separated "
                                       "(table and markdown), e.g. default,trials or "
                                       "shape,winner,us,config; an unknown name lists them "
                                       "all."),
    configs: bool = typer.Option(False, "--configs", help="Also list each winner's config "
                                 "(a column in markdown, lines under the table otherwise)."),
    hide_superseded: bool = typer.Option(False, "--hide-superseded", help="Leave out winners "
                                         "whose kernel sources were measured in a newer "
                                         "version since."),
    html: Path | None = typer.Option(None, "--html", help="Also write a self-contained HTML "
                                     "report with charts to this file."),
    png: Path | None = typer.Option(None, "--png", help="Also write the charts as PNG files "
                                    "into this directory (needs matplotlib: the 'report' extra)."),
) -> None:
    """Winners with time, bandwidth vs the device's measured ceiling, and speedups. The
    table fits 80 columns: pick others with --columns, see configs with --configs."""
    from mla_tune.problem.suites import UnknownSuiteError, suite_shapes
    from mla_tune.reports.html import (
        MissingDependencyError,
        require_matplotlib,
        write_html,
        write_pngs,
    )
    from mla_tune.reports.table import (
        DEFAULT_COLUMNS,
        markdown_report,
        parse_columns,
        shape_matcher,
    )

    if fmt not in ("table", "markdown", "json", "csv"):
        fail(f"unknown format {fmt!r}; choose table, markdown, json or csv")
    try:
        cols = parse_columns(columns) if columns else list(DEFAULT_COLUMNS)
        wanted = shape_matcher(shape) if shape is not None else None
    except ValueError as exc:
        fail(str(exc))
    suite_list = None
    if suite:
        try:
            suite_list = suite_shapes(suite)
        except UnknownSuiteError as exc:
            fail(str(exc))
    if html is not None and html.is_dir():
        fail(f"--html {html} is a directory; give a file name, e.g. {html / 'report.html'}")
    if png is not None:
        if png.exists() and not png.is_dir():
            fail(f"--png {png} is a file; give a directory for the PNG charts")
        try:
            require_matplotlib()
        except MissingDependencyError as exc:
            fail(str(exc))
    store = open_store(db, read_only=True)
    with _report_reading(store):
        rows = _report_rows(store, wanted, shape, software, suite_list)
        if hide_superseded:
            rows = [r for r in rows if not r.superseded]
        if html is not None:
            write_html(store, rows, html, suite_list, suite)
            console.print(f"wrote {escape(str(html))}", highlight=False)
        if png is not None:
            written = write_pngs(store, rows, png)
            console.print(f"wrote {len(written)} PNG chart(s) to {escape(str(png))}",
                          highlight=False)
    if fmt == "json":
        out.print_json(json.dumps([r.to_json() for r in rows]))
        return
    if fmt == "csv":
        buf = io.StringIO()
        fields = list(rows[0].to_json()) if rows else ["shape"]
        writer = csv.DictWriter(buf, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v
                             for k, v in r.to_json().items()})
        sys.stdout.write(buf.getvalue())
        return
    if not rows:
        console.print("no winners stored yet: run `mla-tune sweep --shape 4x1024` first"
                      if shape is None and software is None and suite is None
                      and not hide_superseded else "no winners match the filters given",
                      highlight=False)
        return
    if fmt == "markdown":
        sys.stdout.write(markdown_report(rows, suite_list, cols + ["config"] * configs))
        return
    _print_report(rows, suite_list, cols, configs, out)


@contextlib.contextmanager
def _report_reading(store: Any) -> Iterator[None]:
    """Reading a DB for a report: rows the store skipped are warned about by name; a DB too
    damaged to read (garbage pages, a dropped table) is exit 2 with what to do."""
    from sqlalchemy.exc import DBAPIError

    from mla_tune.db import DBError, db_failure

    store_log = logging.getLogger("mla_tune.db.store")
    quiet = store_log.disabled
    store_log.disabled = True  # its skipped rows are warned about here, once
    try:
        yield
    except DBError as exc:
        fail(str(exc))
    except DBAPIError as exc:
        failure = db_failure(exc, store.url)
        fail(str(failure) if failure is not None else
             f"cannot read the tuning DB {store.url}: {str(exc.orig or exc)[:300]}. It is "
             "damaged or was not written by this mla-tune: restore a backup, or check --db")
    finally:
        store_log.disabled = quiet
        for message in store.skipped:
            warn(f"skipped {message}")
        store.close()


def _report_rows(store: Any, wanted: Any, shape: str | None, software: str | None,
                 suite_list: Sequence[Shape] | None) -> list[Any]:
    """The report's rows; with --shape, those it names, or exit 2 listing what exists."""
    from mla_tune.reports.table import nearest_shapes, report_rows, suite_keys

    rows = report_rows(store, software_hash=software,
                       shape_keys=suite_keys(suite_list) if suite_list is not None else None)
    if wanted is None:
        return rows
    match = [r for r in rows if wanted(r.shape)]
    if not match:
        stored = list({r.shape.key: r.shape for r in rows}.values())
        near = [s.label() for s in nearest_shapes(shape or "", stored)[:NEAREST_LISTED]]
        more = (f" and {len(stored) - len(near)} more (`mla-tune report` lists them all)"
                if len(stored) > len(near) else "")
        fail(f"no stored winner for shape {shape!r} in {store.url}; the nearest shapes with "
             f"winners: {', '.join(near) or '(none)'}{more}")
    return match


def _print_report(rows: Sequence[Any], suite: Sequence[Shape] | None,
                  columns: Sequence[str], configs: bool, to: Console) -> None:
    """One table per device and stack (its title names them), the marks explained, and its
    baselines and geomeans. Every cell is plain text: nothing stored is read as markup."""
    from rich import box
    from rich.text import Text

    from mla_tune.reports.table import (
        COLUMNS,
        config_text,
        summary_lines,
        table_notes,
        thin_sweeps,
    )

    groups: dict[tuple[str, str], list[Any]] = {}
    for r in rows:
        groups.setdefault((r.device, r.software_hash), []).append(r)
    for (device, sw), group in groups.items():
        table = Table(title=Text(f"{device} · stack {sw[:8]} · {len(group)} winners"),
                      title_justify="left", box=box.SIMPLE_HEAD, padding=0)
        for name in columns:
            c = COLUMNS[name]
            table.add_column(c.header, justify="right" if c.numeric else "left",
                             overflow="fold")
        for r in group:
            table.add_row(*(Text(COLUMNS[name].cell(r)) for name in columns))
        to.print(table)
        for line in (table_notes(group) + thin_sweeps(rows, group)
                     + summary_lines(rows, suite, (device, sw))):
            to.print(line, markup=False, highlight=False, emoji=False, soft_wrap=False)
        if configs:
            to.print("configs:", highlight=False)
            for r in group:
                to.print(f"  {r.shape.label()} {r.winner_label}: {config_text(r.config)}",
                         markup=False, highlight=False, emoji=False, soft_wrap=False)
        to.print()
