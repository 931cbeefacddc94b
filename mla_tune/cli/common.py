"""What every command shares: the Typer app, the two consoles (messages on stderr, tables
on stdout), the exit-2 error, and the parsing of DB, KV-format and shape options."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mla_tune.problem.shapes import KVFormat, Shape, ShapeError, parse_shape

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Autotune MLA decode kernels and keep the results in a tuning DB.")


# Messages are printed unwrapped (the terminal wraps them); only tables follow the width, so
# no message is cut inside a path or a command to copy.
# No markup and no :emoji: codes: file names, DB values and error texts hold brackets and
# colons, and are printed as they are (a style is given as a style, never inside the text).
console = Console(stderr=True, soft_wrap=True, markup=False, emoji=False)


out = Console(soft_wrap=True, markup=False, emoji=False)


LOG_ENV = "MLA_TUNE_LOG"


log = logging.getLogger("mla_tune.cli.main")


def _print_version(value: bool) -> None:
    if value:
        from mla_tune import __version__

        out.print(f"mla-tune {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _configure_logging(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """$MLA_TUNE_LOG=debug (or info) logs to stderr where a sweep's time goes: start-up
    steps, the compile stage, and each trial's phases."""
    level = os.environ.get(LOG_ENV)
    if level:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f ms %(name)s: %(message)s"))
        logger = logging.getLogger("mla_tune")
        logger.addHandler(handler)
        try:
            logger.setLevel(level.upper())
        except ValueError:
            fail(f"{LOG_ENV}={level!r} is not a log level; use debug, info or warning")


DB_HELP = ("Tuning DB: a SQLAlchemy URL, a SQLite file path, or shipped (the H200 results "
           "shipped with mla-tune, read-only) (default: $MLA_TUNE_DB or tuning.db).")


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a clear error and exit non-zero."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True)
    raise typer.Exit(code)


def parse_formats(values: Sequence[str]) -> list[KVFormat]:
    formats: list[KVFormat] = []
    for v in values or ["all"]:
        for part in v.split(","):
            if part.strip().lower() == "all":
                formats.extend(KVFormat)
            else:
                try:
                    formats.append(KVFormat.parse(part))
                except ValueError as exc:
                    fail(f"{exc} (or 'all')")
    return list(dict.fromkeys(formats))


def open_store(db: str | None, *, read_only: bool = False) -> Any:
    """The tuning DB; `read_only` opens it as it is (it must exist; nothing is created or
    migrated)."""
    from mla_tune.db import DBError, TuningStore

    try:
        return TuningStore(db, read_only=read_only)
    except DBError as exc:
        fail(str(exc))


def tuning_shapes(shape: list[str], suite: str | None, formats: list[KVFormat], heads: int,
            q_len: int, page_size: int, ragged: str | None = None,
            ragged_seed: int = 0, suite_formats: bool = True) -> list[Shape]:
    """The shapes of `--shape` (each in every one of `formats`) and of `--suite` (in
    `formats` when `suite_formats`, i.e. the user named them, else in those the suite
    declares)."""
    from mla_tune.problem.shapes import RaggedLengths, parse_ragged_shape
    from mla_tune.problem.suites import UnknownSuiteError, suite_shapes

    shapes: list[Shape] = []
    try:
        dist = RaggedLengths.parse(ragged, ragged_seed) if ragged else None
        if dist is not None and not shape:
            fail("--ragged needs --shape BATCH or BATCHxKV (KV caps the drawn lengths)")
        for text in shape:
            for fmt in formats:
                if dist is not None:
                    shapes.append(parse_ragged_shape(text, dist, q_len=q_len, heads=heads,
                                                     kv_format=fmt, page_size=page_size))
                else:
                    shapes.append(parse_shape(text, q_len=q_len, heads=heads, kv_format=fmt,
                                              page_size=page_size))
        if suite:
            shapes += suite_shapes(suite, formats if suite_formats else None)
    except (ShapeError, UnknownSuiteError) as exc:
        fail(str(exc))
    if not shapes:
        fail("nothing to tune: give --shape BATCHxKV (e.g. --shape 256x8192) or --suite NAME")
    return list(dict.fromkeys(shapes))


def warn(message: str) -> None:
    console.print(f"warning: {message}", markup=False, highlight=False, emoji=False)


def existing_store(db: str | None) -> Any:
    """A writable store on a tuning DB that must already exist: nothing is created."""
    open_store(db, read_only=True).close()
    return open_store(db)


def listing(title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> Table:
    """A table of rows; integer columns right-aligned."""
    table = Table(title=title)
    numeric = [bool(rows) and all(isinstance(r[i], int) for r in rows)
               for i in range(len(columns))]
    for col, num in zip(columns, numeric):
        table.add_column(col, justify="right" if num else "left")
    for r in rows:
        table.add_row(*(str(v) for v in r))
    return table
