"""`mla-tune` command line: thin wrappers over sweep, report, diff, export/import and doctor.

Bad input exits with code 2 and a message saying what was wrong and what to do; nothing
stored is touched before the input has been validated.
"""

from __future__ import annotations

import contextlib
import csv
import inspect
import io
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from mla_tune.problem import KVFormat, Shape, ShapeError, parse_shape

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Autotune MLA decode kernels and keep the results in a tuning DB.")
# Messages are printed unwrapped (the terminal wraps them); only tables follow the width, so
# no message is cut inside a path or a command to copy.
# No markup and no :emoji: codes: file names, DB values and error texts hold brackets and
# colons, and are printed as they are (a style is given as a style, never inside the text).
console = Console(stderr=True, soft_wrap=True, markup=False, emoji=False)
out = Console(soft_wrap=True, markup=False, emoji=False)

LOG_ENV = "MLA_TUNE_LOG"
log = logging.getLogger("mla_tune.cli")


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


def _formats(values: Sequence[str]) -> list[KVFormat]:
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


def _default_device() -> str:
    from mla_tune.sweep_devices import default_device

    return default_device()


def _open_store(db: str | None, *, read_only: bool = False) -> Any:
    """The tuning DB; `read_only` opens it as it is (it must exist; nothing is created or
    migrated)."""
    from mla_tune.db import DBError, TuningStore

    try:
        return TuningStore(db, read_only=read_only)
    except DBError as exc:
        fail(str(exc))


def _shapes(shape: list[str], suite: str | None, formats: list[KVFormat], heads: int,
            q_len: int, page_size: int, ragged: str | None = None,
            ragged_seed: int = 0) -> list[Shape]:
    from mla_tune.problem import RaggedLengths, parse_ragged_shape
    from mla_tune.suites import UnknownSuiteError, suite_shapes

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
            shapes += suite_shapes(suite, formats if formats != list(KVFormat) else None)
    except (ShapeError, UnknownSuiteError) as exc:
        fail(str(exc))
    if not shapes:
        fail("nothing to tune: give --shape BATCHxKV (e.g. --shape 256x8192) or --suite NAME")
    return list(dict.fromkeys(shapes))


@app.command()
def sweep(
    shape: list[str] = typer.Option([], "--shape", "-s", help="BATCHxKV, e.g. 256x8192 (repeatable)."),
    suite: str | None = typer.Option(None, help="A shape suite from configs/suites.toml."),
    kv_format: list[str] = typer.Option(["all"], "--kv-format", "-f", help="bf16, fp8, mxfp4 or all."),
    heads: int = typer.Option(16, min=1, max=128, help="Query heads per KV head, 1-128 (DeepSeek-V3's 128 split by tensor parallelism: 16, 32, 64, 128); a backend that cannot run a count says so."),
    q_len: int = typer.Option(1, "--q-len", help="Query tokens per sequence (1-4)."),
    page_size: int = typer.Option(1, "--page-size", help="KV page size of the shape."),
    ragged: str | None = typer.Option(None, "--ragged", help="Tune a serving bucket on a ragged batch: kv lengths drawn from uniform:LOW-HIGH (e.g. --shape 32 --ragged uniform:300-8000; a KV in --shape caps the lengths). The dispatcher uses its winner for every call of the bucket."),
    ragged_seed: int = typer.Option(0, "--ragged-seed", help="Seed of the --ragged lengths (the same seed draws the same batch on any machine)."),
    backend: list[str] = typer.Option([], "--backend", "-b", help="Kernel family (repeatable; default all)."),
    db: str | None = typer.Option(None, help=DB_HELP),
    strategy: str = typer.Option("grid", help="grid, tpe or random."),
    budget: int | None = typer.Option(None, min=1, help="Max configs measured per shape and backend, by all sweeps of the DB together."),
    device: str | None = typer.Option(None, help="cuda or cpu (default: cuda when present)."),
    gpus: str | None = typer.Option(None, help="GPUs to tune on, one worker process each: N or all (default 1)."),
    candidate_timeout: float = typer.Option(120.0, "--candidate-timeout", min=1.0, help="Seconds one candidate may take, build included, before it is recorded as timeout."),
    time_budget: float = typer.Option(1.0, "--time-budget", min=0.01, help="Seconds of timing per candidate."),
    no_baseline: bool = typer.Option(False, "--no-baseline", help="Do not add library/torch baselines."),
    seed: int = typer.Option(0, help="Input seed."),
    pin: list[str] = typer.Option([], "--pin", help="Narrow a knob: BACKEND.KNOB=V1[,V2...], e.g. triton.num_splits=1,4 (repeatable)."),
    no_compile_ahead: bool = typer.Option(False, "--no-compile-ahead", help="Skip the compile stage (each GPU worker then compiles the kernels it meets)."),
    retry: list[str] = typer.Option([], "--retry", help="Measure again the stored trials with this outcome: failed, timeout or wrong (repeatable), e.g. after a transient out-of-memory."),
    runoff: int = typer.Option(3, "--runoff", min=0, help="Time each shape's fastest K variants (and each other backend's fastest) again side by side, in turn; each keeps the better of its two timings. 0 or 1 keeps the first times."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the candidates per shape and backend (and why a backend is skipped), then stop: nothing is run or stored."),
) -> None:
    """Tune shapes: enumerate variants, verify each against the reference, time it, store it.

    Candidates run in worker processes (one per GPU), so a crashing or hanging variant is
    recorded and the sweep goes on. Interrupt it at any moment and run the same command
    again to finish; several sweeps on one DB share the work."""
    from mla_tune.backends import UnknownBackendError
    from mla_tune.db import db_failure
    from mla_tune.search import Strategy
    from mla_tune.sweep import (
        SweepError,
        SweepInterrupted,
        SweepOptions,
        resolve_backends,
        run_sweep,
    )
    from mla_tune.timing import TimingPolicy
    from mla_tune.ui import SweepProgress

    formats = _formats(kv_format)
    shapes = _shapes(shape, suite, formats, heads, q_len, page_size, ragged, ragged_seed)
    retry_statuses = tuple(dict.fromkeys(retry))
    if set(retry_statuses) - {"failed", "timeout", "wrong"}:
        fail(f"--retry takes failed, timeout or wrong (a trial's outcome), got "
             f"{', '.join(retry_statuses)}")
    try:
        strat = Strategy(strategy)
    except ValueError:
        fail(f"unknown strategy {strategy!r}; choose grid, tpe or random")
    try:
        backends = resolve_backends(backend, not no_baseline)
    except UnknownBackendError as exc:
        fail(str(exc))
    devices = _sweep_devices(device or _default_device(), gpus)
    pins = _pins(pin, devices[0])
    if dry_run:
        _print_plan(shapes, backends, devices[0], pins)
        return
    log.debug("sweep arguments checked")
    store = _open_store(db)
    log.debug("tuning DB open")
    options = SweepOptions(devices=devices, strategy=strat, budget=budget, seed=seed,
                           policy=TimingPolicy(budget_s=time_budget), baselines=not no_baseline,
                           candidate_timeout_s=candidate_timeout, pins=pins,
                           compile_ahead=not no_compile_ahead, retry=retry_statuses,
                           runoff=runoff)
    # SIGTERM stops the sweep as cleanly as Ctrl-C (workers ignore both; the driver ends them).
    previous = {s: signal.signal(s, _interrupt) for s in _STOP_SIGNALS}
    try:
        with SweepProgress(console) as progress:
            results = run_sweep(shapes, backends, store, options, progress)
    except SweepInterrupted as stop:
        if stop.results:
            _print_winners(stop.results)
        console.print(f"interrupted: {stop.new_trials} new trial(s) stored in {store.url}, "
                      f"{len(stop.results)} shape(s) finished; {stop.requeued} candidate(s) "
                      "being measured went back to the queue. Run the same command again to "
                      "finish.", highlight=False)
        raise typer.Exit(130) from None
    except SweepError as exc:
        fail(str(exc), code=1)
    except Exception as exc:  # the DB's disk filled up or its file is damaged
        failure = db_failure(exc, store.url)
        if failure is None:
            raise
        fail(str(failure))
    finally:
        if signal.getsignal(signal.SIGINT) is _interrupt:  # not stopped: as before
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        store.close()
    _print_winners(results)


def _pins(texts: Sequence[str], device: str) -> dict[str, dict[str, list[Any]]]:
    """Parse `--pin` options and check each against its backend's declared space."""
    from mla_tune.backends import UnknownBackendError, get_backend
    from mla_tune.space import ConfigError, parse_pin

    pins: dict[str, dict[str, list[Any]]] = {}
    try:
        for text in texts:
            backend, knob, values = parse_pin(text)
            pins.setdefault(backend, {})[knob] = values
        for backend, knobs in pins.items():
            get_backend(backend).declared_space(device.split(":")[0]).restrict(knobs)
    except (ConfigError, UnknownBackendError) as exc:
        fail(f"--pin: {exc}")
    return pins


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt(signum: int, frame: Any) -> None:
    """Stop the sweep cleanly. Later Ctrl-Cs and SIGTERMs are ignored until the process
    exits: the clean stop (workers ended, claims put back, connections closed) is short,
    and interrupting it would only print tracebacks and leave claims to go stale."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _sweep_devices(dev: str, gpus: str | None) -> tuple[str, ...]:
    from mla_tune.sweep_devices import DeviceChoiceError, sweep_devices

    try:
        return sweep_devices(dev, gpus)
    except DeviceChoiceError as exc:
        fail(str(exc))


def _print_plan(shapes: Sequence[Shape], backends: Sequence[Any], device: str,
                pins: dict[str, dict[str, list[Any]]]) -> None:
    """What a sweep would measure: feasible candidates per shape and backend."""
    import torch

    from mla_tune.sweep_plan import plan_sweep

    plan = plan_sweep(shapes, backends, torch.device(device), pins)
    table = Table(title=f"sweep plan on {device}")
    for col in ("shape", *plan.backends):
        table.add_column(col)
    for shape, counts in plan.rows:
        table.add_row(shape.label(), *("-" if n is None else str(n) for n in counts))
    out.print(table)
    out.print(f"{plan.total} candidates in all")
    for name, reason in plan.skipped.items():
        console.print(f"skipped {name}: {reason}", highlight=False)


def _print_winners(results: Sequence[Any]) -> None:
    table = Table(title="winners")
    for col in ("shape", "backend", "config", "median µs", "new", "reused", "side by side"):
        table.add_column(col)
    for r in results:
        w = r.winner
        new = sum(b.new_trials for b in r.backends)
        reused = sum(b.reused_trials for b in r.backends)
        together = str(r.side_by_side) if r.side_by_side else "-"
        if w is None:
            table.add_row(r.shape.label(), "-", "no correct variant", "-", str(new), str(reused),
                          together)
        else:
            table.add_row(r.shape.label(), w.backend, json.dumps(w.config, sort_keys=True),
                          f"{w.median_us:.1f}", str(new), str(reused), together)
    out.print(table)
    if any(r.side_by_side for r in results):
        console.print("side by side: finalists timed again in one interleaved run; each keeps "
                      "the better of its two timings", highlight=False, style="dim")
    skipped = {(b.name, b.skipped) for r in results for b in r.backends if b.skipped}
    for name, reason in sorted(skipped):
        console.print(f"skipped {name}: {reason}", highlight=False)


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
    from mla_tune.report import DEFAULT_COLUMNS, markdown_report, parse_columns, shape_matcher
    from mla_tune.report_html import (
        MissingDependencyError,
        require_matplotlib,
        write_html,
        write_pngs,
    )
    from mla_tune.suites import UnknownSuiteError, suite_shapes

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
    store = _open_store(db, read_only=True)
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
            _warn(f"skipped {message}")
        store.close()


def _warn(message: str) -> None:
    console.print(f"warning: {message}", markup=False, highlight=False, emoji=False)


def _report_rows(store: Any, wanted: Any, shape: str | None, software: str | None,
                 suite_list: Sequence[Shape] | None) -> list[Any]:
    """The report's rows; with --shape, those it names, or exit 2 listing what exists."""
    from mla_tune.report import report_rows, suite_keys

    skipped: list[str] = []
    rows = report_rows(store, software_hash=software, skipped=skipped,
                       shape_keys=suite_keys(suite_list) if suite_list is not None else None)
    for message in skipped:
        _warn(f"skipped {message}")
    if wanted is None:
        return rows
    match = [r for r in rows if wanted(r.shape)]
    if not match:
        sizes = list(dict.fromkeys(r.shape.label() for r in rows))
        fail(f"no stored winner for shape {shape!r} in {store.url}; shapes with winners: "
             f"{', '.join(sizes) or '(none)'}")
    return match


def _print_report(rows: Sequence[Any], suite: Sequence[Shape] | None,
                  columns: Sequence[str], configs: bool, to: Console) -> None:
    """One table per device and stack (its title names them), the marks explained, and its
    baselines and geomeans. Every cell is plain text: nothing stored is read as markup."""
    from rich import box
    from rich.text import Text

    from mla_tune.report import COLUMNS, config_text, summary_lines, table_notes

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
        for line in table_notes(group) + summary_lines(rows, suite, (device, sw)):
            to.print(line, markup=False, highlight=False, emoji=False, soft_wrap=False)
        if configs:
            to.print("configs:", highlight=False)
            for r in group:
                to.print(f"  {r.shape.label()} {r.winner_label}: {config_text(r.config)}",
                         markup=False, highlight=False, emoji=False, soft_wrap=False)
        to.print()

@app.command()
def doctor(device: str | None = typer.Option(None, help="cuda or cpu."),
           db: str | None = typer.Option(None, help=DB_HELP)) -> None:
    """Device, versions, which backends are available (and why not), and how many stored
    winners the dispatcher would use here."""
    import torch

    from mla_tune.backends import backend_names, get_backend
    from mla_tune.db import resolve_url
    from mla_tune.dispatch import Dispatcher
    from mla_tune.fingerprint import current_device, current_software

    try:
        dev = torch.device(device or _default_device())
        fp = current_device(dev)
    except (RuntimeError, ValueError) as exc:
        fail(f"cannot use device {device!r}: {exc}; use cpu, cuda or cuda:N")
    out.print(f"device: {fp.name} ({fp.vendor}, {fp.arch}, {fp.sm_count} SMs/cores, "
              f"{fp.memory_bytes / 2**30:.1f} GiB) fingerprint {fp.hash}")
    sw = current_software()
    out.print("software: " + ", ".join(f"{k} {v}" for k, v in sw.versions))
    out.print(f"tuning DB: {resolve_url(db).render_as_string(hide_password=True)}")
    out.print(f"winners usable here: {Dispatcher.from_db(db, dev).summary()}", highlight=False)
    stale, retired = _stale_and_retired_trials(db)
    if stale:
        out.print(f"{stale} stored trials are of this checkout's kernel code under its old "
                  "(bytes) source hash (`mla-tune rehash` renames them)", highlight=False)
    if retired:
        out.print(f"{retired} stored trials are of retired kernel sources (`mla-tune prune` "
                  "lists and deletes them)", highlight=False)
    table = Table(title="backends")
    for col in ("backend", "available", "why not"):
        table.add_column(col)
    for name in backend_names():
        try:
            avail = get_backend(name).available(dev)
            table.add_row(name, "yes" if avail else "no", avail.reason)
        except Exception as exc:  # noqa: BLE001 - doctor reports, never crashes
            table.add_row(name, "no", f"{type(exc).__name__}: {exc}")
    out.print(table)
    from mla_tune.backends.compiled_toolchain import compilers_summary

    out.print(f"compiled-source families: {compilers_summary()}", highlight=False)


def _stale_and_retired_trials(db: str | None) -> tuple[int, int]:
    """Trials `rehash` would rename and trials `prune` would delete (read-only; zeros when
    the DB cannot be read)."""
    from mla_tune.backends import source_hash_pairs
    from mla_tune.db import DBError, TuningStore
    from mla_tune.prune import retired_trials, unrenamed_trials

    pairs = source_hash_pairs()
    try:
        with TuningStore(db, read_only=True) as store:
            return (unrenamed_trials(store, pairs),
                    retired_trials(store, {b: new for b, (_, new) in pairs.items()}))
    except DBError:
        return 0, 0


_STACK_HASH = re.compile(r"[0-9a-f]{4,64}")


def _diff_side(ref: str, db: str | None) -> Any:
    """A DB (URL or existing file) or a software stack hash prefix of `db`."""
    from mla_tune.diff import DiffSide

    if _STACK_HASH.fullmatch(ref) and not Path(ref).exists():
        from mla_tune.fingerprint import resolve_hash_prefix

        store = _open_store(db, read_only=True)
        try:
            stack = resolve_hash_prefix(ref, [w.software.hash for w in store.winners()],
                                        "software stack")
        except ValueError as exc:
            fail(f"{exc} (stacks with winners in {store.url})")
        return DiffSide.load(store, f"stack {stack[:8]}", stack)
    if "://" not in ref and not Path(ref).is_file():
        fail(f"{ref!r} is neither a tuning DB file nor a software stack hash of --db; give a "
             "DB path or URL, or a hash from `mla-tune report --format json`")
    return DiffSide.load(_open_store(ref, read_only=True), ref)


@app.command()
def diff(
    before: str = typer.Argument(..., help="Earlier run: a tuning DB (path or URL), or a "
                                 "software stack hash (prefix) in --db."),
    after: str = typer.Argument(..., help="Later run, in the same forms as BEFORE."),
    db: str | None = typer.Option(None, help=DB_HELP + " Holds the stacks named by hash."),
    min_change: float | None = typer.Option(None, "--min-change", min=0.0, help="Smallest "
                                            "relative change flagged, on top of the measured "
                                            "noise [default: 0.03]."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
    fail_on_regression: bool = typer.Option(False, "--fail-on-regression",
                                            help="Exit 1 when any shape regressed."),
) -> None:
    """Per shape: winner and time before and after, regressions beyond the noise flagged."""
    from mla_tune.diff import DEFAULT_MIN_CHANGE, compare, stack_changes, summarize_diff

    if fmt not in ("table", "json"):
        fail(f"unknown format {fmt!r}; choose table or json")
    if min_change is None:
        min_change = DEFAULT_MIN_CHANGE
    side_a, side_b = _diff_side(before, db), _diff_side(after, db)
    rows = compare(side_a, side_b, min_change)
    summary = summarize_diff(rows)
    changes = stack_changes(side_a, side_b)
    if fmt == "json":
        out.print_json(json.dumps({
            "before": side_a.label, "after": side_b.label, "min_change": min_change,
            "software_changes": {k: list(v) for k, v in changes.items()},
            "rows": [d.to_json() for d in rows], "geomeans": [g.to_json() for g in summary]}))
    else:
        _print_diff(side_a.label, side_b.label, rows, summary, changes)
    if fail_on_regression and any(d.status == "regression" for d in rows):
        raise typer.Exit(1)


def _print_diff(label_a: str, label_b: str, rows: Sequence[Any], summary: Sequence[Any],
                changes: dict[str, tuple[str | None, str | None]]) -> None:
    def us(r: Any) -> str:
        if r is None:
            return "-"
        return f"{r.median_us:.1f}" + (f" ±{r.ci95_us:.1f}" if r.ci95_us is not None else "")

    def winner(r: Any) -> str:
        return "-" if r is None else f"{r.backend} {json.dumps(r.config, sort_keys=True)}"

    style = {"regression": "bold red", "improvement": "green"}
    multi = len({d.device for d in rows}) > 1
    table = Table(title=f"{label_a} -> {label_b}")
    for col in (["device"] if multi else []) + ["shape", "winner before", "winner after",
                                                "µs before", "µs after", "change", "noise µs",
                                                "status"]:
        table.add_column(col, overflow="fold")
    for d in rows:
        after_winner = "same" if d.before and d.after and not d.winner_changed else winner(d.after)
        status = d.status
        if status in style:
            status = Text(status, style=style[status])
        table.add_row(*([d.device] if multi else []), d.shape.label(), winner(d.before),
                      after_winner, us(d.before), us(d.after),
                      f"{d.change:+.1%}" if d.change is not None else "-",
                      f"±{d.noise_us:.1f}" if d.noise_us is not None else "-", status)
    out.print(table)
    for pkg, (va, vb) in changes.items():
        out.print(f"software: {pkg} {va or '(absent)'} -> {vb or '(absent)'}", highlight=False)
    for g in summary:
        out.print(f"geometric mean {g.kv_format} on {g.device}: {g.before_us:.1f} -> "
                  f"{g.after_us:.1f} µs ({g.change:+.1%}) over {g.shapes} common shapes",
                  highlight=False)
    from mla_tune.diff import STATUSES

    counts = {s: sum(d.status == s for d in rows) for s in STATUSES}
    out.print(", ".join(f"{n} {s}" for s, n in counts.items()), highlight=False)


@app.command("export")
def export_cmd(
    out_path: Path | None = typer.Option(None, "--out", "-o", help="The winners JSON file to write."),
    db: str | None = typer.Option(None, help=DB_HELP),
    device: str | None = typer.Option(None, help="Only this device (fingerprint hash prefix)."),
    submission: Path | None = typer.Option(None, help="Write a one-file leaderboard submission (custom_kernel, the device's winners and their Triton kernels inlined; no mla-tune needed to run it) instead of JSON."),
    suite: str | None = typer.Option(None, help="With --submission: the shapes it is for (a suite of configs/suites.toml); their expected times go in its header."),
    shape: list[str] = typer.Option([], "--shape", "-s", help="With --submission: BATCHxKV shapes it is for (repeatable), with --heads and --q-len."),
    heads: int = typer.Option(16, min=1, max=128, help="With --shape: query heads."),
    q_len: int = typer.Option(1, "--q-len", help="With --shape: query tokens per sequence (1-4)."),
    leaderboard: str | None = typer.Option(None, help="With --submission: write a '#!POPCORN leaderboard NAME' line."),
    gpu: str | None = typer.Option(None, help="With --submission: write a '#!POPCORN gpu NAME' line."),
) -> None:
    """Write the winners table as a versioned JSON document (device and software included),
    or with --submission one self-contained Python file to submit to a leaderboard."""
    from mla_tune.winners_json import export_winners

    if (out_path is None) == (submission is None):
        fail("give exactly one of --out FILE.json (winners JSON) or --submission FILE.py")
    target = out_path if out_path is not None else submission
    assert target is not None
    if target.is_dir() or not target.absolute().parent.is_dir():
        fail(f"{'--out' if out_path else '--submission'} {target}: give a file path in an "
             "existing directory")
    if out_path is not None and (suite or shape or leaderboard or gpu):
        fail("--suite, --shape, --leaderboard and --gpu apply to --submission only")
    shapes = _shapes(shape, suite, [KVFormat.BF16], heads, q_len, 1) if (suite or shape) else []
    store = _open_store(db, read_only=True)
    device_hash = None
    if device is not None:
        from mla_tune.fingerprint import resolve_hash_prefix

        try:
            device_hash = resolve_hash_prefix(device, [d.hash for d in store.devices()],
                                              "device")
        except ValueError as exc:
            fail(f"{exc} (in {store.url})")
    if submission is not None:
        from mla_tune.export_submission import SubmissionError, write_submission

        try:
            sub = write_submission(store, submission, device_hash=device_hash,
                                   db_label=db or os.environ.get("MLA_TUNE_DB") or "tuning.db",
                                   shapes=shapes, leaderboard=leaderboard, gpu=gpu)
        except SubmissionError as exc:
            fail(str(exc))
        left = "; ".join(f"{n} {why}" for why, n in sorted(sub.left_out.items()))
        console.print(f"wrote {submission}: {sub.winners} winners" +
                      (f" (left out: {left})" if left else ""), highlight=False)
        return
    assert out_path is not None
    n = export_winners(store, out_path, device_hash=device_hash)
    console.print(f"wrote {n} winners to {out_path}")


@app.command("import")
def import_cmd(
    path: Path = typer.Argument(..., help="A winners JSON file written by `mla-tune export`."),
    db: str | None = typer.Option(None, help=DB_HELP),
) -> None:
    """Add the winners of a JSON file to the DB; each competes with the trials already there."""
    from mla_tune.winners_json import WinnersFileError, import_winners, load_winners_json

    try:
        records = load_winners_json(path)  # validated before the DB is opened or written
    except (OSError, WinnersFileError) as exc:
        fail(f"cannot import {path}: {exc}")
    store = _open_store(db)
    s = import_winners(store, path, records)
    console.print(f"imported {s.trials} winners into {store.url}: {s.won} now win their "
                  f"shape; {s.not_current} kept as trials only (backend unknown here or "
                  "kernel sources differ)")


@app.command()
def prune(
    db: str | None = typer.Option(None, help=DB_HELP),
    yes: bool = typer.Option(False, "--yes", help="Delete them; without it, only list them."),
) -> None:
    """Delete trials, queued work and search studies of retired kernel sources (neither this
    checkout's nor the newest measured); winners and the trials they name stay."""
    from mla_tune.backends import source_hash_pairs
    from mla_tune.db import sqlite_file_size
    from mla_tune.prune import find_retired, unrenamed_trials
    from mla_tune.prune import prune as prune_sources

    store = _existing_store(db)
    pairs = source_hash_pairs()
    stale = unrenamed_trials(store, pairs)
    if stale:
        fail(f"{stale} stored trials in {store.url} are of this checkout's kernel code under "
             "its old (bytes) source hash; run `mla-tune rehash --yes` first, so prune keeps "
             "them")
    retired = find_retired(store, {b: new for b, (_, new) in pairs.items()})
    if not retired:
        console.print(f"nothing to prune in {store.url}: every stored source is current or "
                      "the newest measured of its backend")
        return
    console.print(_listing(f"retired kernel sources in {store.url}",
                           ("backend", "source", "trials", "studies"),
                           [(r.backend, r.source_hash[:12], r.trials, len(r.studies))
                            for r in retired]))
    if not yes:
        console.print("nothing deleted: run again with --yes to delete these")
        return
    size = sqlite_file_size(store.url)
    done = prune_sources(store, retired)
    after = sqlite_file_size(store.url)
    shrink = f"; file {size / 1e6:.1f} -> {after / 1e6:.1f} MB" if size and after else ""
    console.print(f"deleted {done.rows.trials} trials, {done.rows.claims} queued claims and "
                  f"{done.studies} studies; kept {done.rows.kept_for_winners} trials that "
                  f"stored winners name{shrink}")


@app.command()
def rehash(
    db: str | None = typer.Option(None, help=DB_HELP),
    yes: bool = typer.Option(False, "--yes", help="Rename them; without it, only list them."),
    from_git: str | None = typer.Option(None, "--from-git", help="Instead: results of the same files as they were at this git revision (e.g. HEAD~3), after a change that keeps what every stored variant runs (a move, rewritten imports, a refactor); say why in the commit."),
    source: list[str] = typer.Option([], "--source", help="Instead: BACKEND=HASH, results stored under that source hash (e.g. before a file joined the family's hashed sources), when that change keeps what every stored variant runs; repeatable; say why in the commit."),
) -> None:
    """Give results stored under the old bytes hash of this checkout's kernel sources the
    current (code-only) hash, so they count as current again."""
    from mla_tune.backends import source_files, source_hash_pairs, source_hashes
    from mla_tune.rehash import GitRevisionError, find, git_hash_pairs
    from mla_tune.rehash import rehash as rehash_sources
    from mla_tune.source_hash import hash_named_sources

    if from_git is not None and source:
        fail("give --from-git or --source, not both")
    if source:
        current = source_hashes()
        pairs = {}
        for item in source:
            backend, _, old = item.partition("=")
            if backend not in current or not old.strip():
                fail(f"--source {item!r}: expected BACKEND=HASH with a backend loadable here "
                     f"({', '.join(current)})")
            pairs[backend] = (old.strip(), current[backend])
        old_name = "the source hash given"
    elif from_git is not None:
        try:
            pairs = git_hash_pairs(from_git, source_files(), hash_named_sources,
                                   source_hashes())
        except GitRevisionError as exc:
            fail(str(exc))
        old_name = f"their hash at {from_git}"
    else:
        pairs, old_name = source_hash_pairs(), "their bytes hash"
    store = _existing_store(db)
    rekeys = find(store, pairs)
    if not rekeys:
        console.print(f"nothing to rehash in {store.url}: no stored source is this "
                      f"checkout's code under {old_name}")
        return
    console.print(_listing(f"sources of this checkout stored under {old_name} in "
                           f"{store.url}", ("backend", "stored as", "renamed to", "trials"),
                           [(r.backend, r.old[:12], r.new[:12], r.trials) for r in rekeys]))
    if not yes:
        console.print("nothing renamed: run again with --yes to rename these")
        return
    done = rehash_sources(store, rekeys)
    console.print(f"renamed {sum(d.trials for d in done)} trials, {sum(d.winners for d in done)} "
                  f"winners and {sum(d.claims for d in done)} queued claims; "
                  f"{sum(d.left for d in done)} trials stay under the old hash (the new one "
                  "already had their config)")


def _existing_store(db: str | None) -> Any:
    """A writable store on a tuning DB that must already exist: nothing is created."""
    _open_store(db, read_only=True).close()
    return _open_store(db)


def _listing(title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> Table:
    """A table of rows; integer columns right-aligned."""
    table = Table(title=title)
    numeric = [bool(rows) and all(isinstance(r[i], int) for r in rows)
               for i in range(len(columns))]
    for col, num in zip(columns, numeric):
        table.add_column(col, justify="right" if num else "left")
    for r in rows:
        table.add_row(*(str(v) for v in r))
    return table


def main() -> None:
    app()


from mla_tune.route_cli import route  # noqa: E402 - registered last, keeps cli.py's order
app.command("route")(route)


def _unwrapped(doc: str) -> str:
    """A docstring's paragraphs each on one line, so help text is wrapped by the terminal's
    width, not where the source happened to break its lines."""
    return "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


for _command in app.registered_commands:
    if _command.help is None and _command.callback is not None and _command.callback.__doc__:
        _command.help = _unwrapped(inspect.getdoc(_command.callback) or "")
