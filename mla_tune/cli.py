"""`mla-tune` command line: thin wrappers over sweep, report and doctor.

Bad input exits with code 2 and a message saying what was wrong and what to do; nothing
stored is touched before the input has been validated.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from mla_tune.problem import KVFormat, Shape, ShapeError, parse_shape

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Autotune MLA decode kernels and keep the results in a tuning DB.")
console = Console(stderr=True)
out = Console()

DB_HELP = "Tuning DB: a SQLAlchemy URL or a SQLite file path (default: $MLA_TUNE_DB or tuning.db)."


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a clear error and exit non-zero."""
    console.print(f"[bold red]error:[/] {message}", highlight=False)
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
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _open_store(db: str | None) -> Any:
    from mla_tune.db import DBError, TuningStore

    try:
        return TuningStore(db)
    except DBError as exc:
        fail(str(exc))


def _shapes(shape: list[str], suite: str | None, formats: list[KVFormat], heads: int,
            q_len: int, page_size: int) -> list[Shape]:
    from mla_tune.suites import UnknownSuiteError, suite_shapes

    shapes: list[Shape] = []
    try:
        for text in shape:
            for fmt in formats:
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
    heads: int = typer.Option(16, help="Query heads (16, 32, 64, 128)."),
    q_len: int = typer.Option(1, "--q-len", help="Query tokens per sequence (1-4)."),
    page_size: int = typer.Option(1, "--page-size", help="KV page size of the shape."),
    backend: list[str] = typer.Option([], "--backend", "-b", help="Kernel family (repeatable; default all)."),
    db: str | None = typer.Option(None, help=DB_HELP),
    strategy: str = typer.Option("grid", help="grid, tpe or random."),
    budget: int | None = typer.Option(None, min=1, help="Max configs measured per shape and backend."),
    device: str | None = typer.Option(None, help="cuda or cpu (default: cuda when present)."),
    time_budget: float = typer.Option(1.0, "--time-budget", min=0.01, help="Seconds of timing per candidate."),
    no_baseline: bool = typer.Option(False, "--no-baseline", help="Do not add library/torch baselines."),
    seed: int = typer.Option(0, help="Input seed."),
) -> None:
    """Tune shapes: enumerate variants, verify each against the reference, time it, store it."""
    from mla_tune.backends import UnknownBackendError, get_backend
    from mla_tune.search import Strategy
    from mla_tune.sweep import SweepOptions, resolve_backends, run_sweep
    from mla_tune.timing import TimingPolicy
    from mla_tune.ui import SweepProgress

    formats = _formats(kv_format)
    shapes = _shapes(shape, suite, formats, heads, q_len, page_size)
    try:
        strat = Strategy(strategy)
    except ValueError:
        fail(f"unknown strategy {strategy!r}; choose grid, tpe or random")
    for name in backend:
        try:
            get_backend(name)
        except UnknownBackendError as exc:
            fail(str(exc))
    dev = device or _default_device()
    if dev not in ("cpu", "cuda") and not dev.startswith("cuda:"):
        fail(f"unknown device {dev!r}; use cpu, cuda or cuda:N")
    if dev.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            fail("--device cuda was asked for but torch sees no GPU; use --device cpu")
    store = _open_store(db)
    options = SweepOptions(device=dev, strategy=strat, budget=budget, seed=seed,
                           policy=TimingPolicy(budget_s=time_budget), baselines=not no_baseline)
    backends = resolve_backends(backend, options.baselines)
    with SweepProgress(console) as progress:
        results = run_sweep(shapes, backends, store, options, progress)
    _print_winners(results)


def _print_winners(results: Sequence[Any]) -> None:
    table = Table(title="winners")
    for col in ("shape", "backend", "config", "median µs", "new", "reused"):
        table.add_column(col)
    for r in results:
        w = r.winner
        new = sum(b.new_trials for b in r.backends)
        reused = sum(b.reused_trials for b in r.backends)
        if w is None:
            table.add_row(r.shape.label(), "-", "no correct variant", "-", str(new), str(reused))
        else:
            table.add_row(r.shape.label(), w.backend, json.dumps(w.config, sort_keys=True),
                          f"{w.median_us:.1f}", str(new), str(reused))
    out.print(table)


@app.command()
def report(
    db: str | None = typer.Option(None, help=DB_HELP),
    shape: str | None = typer.Option(None, help="Only this shape key (see `report --format json`)."),
    fmt: str = typer.Option("table", "--format", help="table, json or csv."),
) -> None:
    """Winners with time, effective bandwidth and speedup over the baselines."""
    from mla_tune.report import geomean, report_rows

    if fmt not in ("table", "json", "csv"):
        fail(f"unknown format {fmt!r}; choose table, json or csv")
    store = _open_store(db)
    rows = report_rows(store, shape_key=shape)
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
        console.print("no winners stored yet: run `mla-tune sweep --shape 4x1024` first")
        return
    table = Table(title=f"tuned winners ({len(rows)})")
    for col in ("device", "shape", "winner", "config", "µs", "±", "GB/s", "% read bw",
                "baseline", "vs baseline", "vs torch", "trials ok/wrong/fail/timeout"):
        table.add_column(col, overflow="fold")
    for r in rows:
        c = r.counts
        table.add_row(
            r.device, r.shape.label(), r.backend, json.dumps(r.config, sort_keys=True),
            f"{r.median_us:.1f}", f"{r.std_us:.1f}" if r.std_us is not None else "-",
            f"{r.eff_gbps:.0f}", f"{r.pct_of_read_bw:.0f}%" if r.pct_of_read_bw else "-",
            f"{r.baseline_backend} {r.baseline_us:.1f}" if r.baseline_us else "-",
            f"{r.speedup_vs_baseline:.2f}x" if r.speedup_vs_baseline else "-",
            f"{r.speedup_vs_torch:.2f}x" if r.speedup_vs_torch else "-",
            f"{c.get('ok', 0)}/{c.get('wrong', 0)}/{c.get('failed', 0)}/{c.get('timeout', 0)}")
    out.print(table)
    g = geomean(r.median_us for r in rows)
    if g:
        out.print(f"geometric mean over {len(rows)} shapes: {g:.1f} µs")


@app.command()
def doctor(device: str | None = typer.Option(None, help="cuda or cpu.")) -> None:
    """Device, versions, and which backends are available (and why not)."""
    import torch

    from mla_tune.backends import backend_names, get_backend
    from mla_tune.fingerprint import current_device, current_software

    dev = torch.device(device or _default_device())
    fp = current_device(dev)
    out.print(f"device: {fp.name} ({fp.vendor}, {fp.arch}, {fp.sm_count} SMs/cores, "
              f"{fp.memory_bytes / 2**30:.1f} GiB) fingerprint {fp.hash}")
    sw = current_software()
    out.print("software: " + ", ".join(f"{k} {v}" for k, v in sw.versions))
    out.print(f"tuning DB: {os.environ.get('MLA_TUNE_DB', 'sqlite:///tuning.db')}")
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


def main() -> None:
    app()
