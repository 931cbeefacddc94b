"""`mla-tune sweep`: parse, plan or run the sweep, print the winners."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

import typer
from rich.table import Table

from mla_tune.cli.common import (
    DB_HELP,
    app,
    console,
    fail,
    log,
    open_store,
    out,
    parse_formats,
    tuning_shapes,
)
from mla_tune.problem.shapes import Shape
from mla_tune.tuning.devices import default_device


@app.command()
def sweep(
    shape: list[str] = typer.Option([], "--shape", "-s", help="BATCHxKV, e.g. 256x8192 (repeatable)."),
    suite: str | None = typer.Option(None, help="A shape suite from configs/suites.toml."),
    kv_format: list[str] = typer.Option([], "--kv-format", "-f", help="bf16, fp8, mxfp4 or all (repeatable). Default: all for --shape, the formats a --suite declares for its shapes (bf16 where it names none)."),
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
    between_calls: str = typer.Option("other-kernels", "--between-calls", help="What runs between two timed calls besides the L2 flush: other-kernels (the leaderboard's condition: its harness draws and checks inputs there) or nothing (back to back)."),
    no_baseline: bool = typer.Option(False, "--no-baseline", help="Do not add library/torch baselines."),
    seed: int = typer.Option(0, help="Input seed."),
    pin: list[str] = typer.Option([], "--pin", help="Narrow a knob: BACKEND.KNOB=V1[,V2...], e.g. triton.num_splits=1,4 (repeatable)."),
    no_compile_ahead: bool = typer.Option(False, "--no-compile-ahead", help="Skip the compile stage (each GPU worker then compiles the kernels it meets)."),
    retry: list[str] = typer.Option([], "--retry", help="Measure again the stored trials with this outcome: failed, timeout or wrong (repeatable), e.g. after a transient out-of-memory."),
    runoff: int = typer.Option(3, "--runoff", min=0, help="Time each shape's fastest K variants (and each other backend's fastest) again side by side, in turn; each keeps the better of its two timings. A shape swept in several KV formats runs off the finalists of every format together, so the format a call runs in is chosen from times of one moment. 0 or 1 keeps the first times."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the candidates per shape and backend (and why a backend is skipped), then stop: nothing is run or stored."),
) -> None:
    """Tune shapes: enumerate variants, verify each against the reference, time it, store it.

    Candidates run in worker processes (one per GPU), so a crashing or hanging variant is
    recorded and the sweep goes on. Interrupt it at any moment and run the same command
    again to finish; several sweeps on one DB share the work."""
    from mla_tune.backends import UnknownBackendError
    from mla_tune.cli.progress import SweepProgress
    from mla_tune.db import db_failure
    from mla_tune.tuning.search import Strategy
    from mla_tune.tuning.sweep import (
        SweepError,
        SweepInterrupted,
        SweepOptions,
        resolve_backends,
        run_sweep,
    )
    from mla_tune.tuning.timing import TimingPolicy

    formats = parse_formats(kv_format)
    shapes = tuning_shapes(shape, suite, formats, heads, q_len, page_size, ragged, ragged_seed,
                           suite_formats=bool(kv_format))
    retry_statuses = tuple(dict.fromkeys(retry))
    if set(retry_statuses) - {"failed", "timeout", "wrong"}:
        fail(f"--retry takes failed, timeout or wrong (a trial's outcome), got "
             f"{', '.join(retry_statuses)}")
    try:
        strat = Strategy(strategy)
    except ValueError:
        fail(f"unknown strategy {strategy!r}; choose grid, tpe or random")
    try:
        policy = TimingPolicy(budget_s=time_budget, between_calls=between_calls)
    except ValueError as exc:
        fail(f"--between-calls: {exc}")
    try:
        backends = resolve_backends(backend, not no_baseline)
    except UnknownBackendError as exc:
        fail(str(exc))
    devices = _sweep_devices(device or default_device(), gpus)
    pins = _pins(pin, devices[0])
    if dry_run:
        _print_plan(shapes, backends, devices[0], pins)
        return
    log.debug("sweep arguments checked")
    store = open_store(db)
    log.debug("tuning DB open")
    options = SweepOptions(devices=devices, strategy=strat, budget=budget, seed=seed,
                           policy=policy, baselines=not no_baseline,
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
    from mla_tune.tuning.space import ConfigError, parse_pin

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
    from mla_tune.tuning.devices import DeviceChoiceError, sweep_devices

    try:
        return sweep_devices(dev, gpus)
    except DeviceChoiceError as exc:
        fail(str(exc))


def _print_plan(shapes: Sequence[Shape], backends: Sequence[Any], device: str,
                pins: dict[str, dict[str, list[Any]]]) -> None:
    """What a sweep would measure: feasible candidates per shape and backend."""
    import torch
    from rich import box

    from mla_tune.tuning.plan import plan_sweep

    plan = plan_sweep(shapes, backends, torch.device(device), pins)
    # Backends that cannot run here are the lines under the table, with their reasons.
    shown = [i for i, name in enumerate(plan.backends) if name not in plan.skipped]
    table = Table(title=f"sweep plan on {device}", title_justify="left", box=box.SIMPLE_HEAD,
                  padding=(0, 1, 0, 0))
    table.add_column("shape", overflow="fold")
    for i in shown:
        table.add_column(plan.backends[i], justify="right", overflow="fold")
    for shape, counts in plan.rows:
        table.add_row(shape.label(), *("-" if counts[i] is None else str(counts[i])
                                       for i in shown))
    out.print(table)
    out.print(f"{plan.total} candidates in all")
    for name, reason in plan.skipped.items():
        console.print(f"skipped {name}: {reason}", highlight=False)


def _print_winners(results: Sequence[Any]) -> None:
    """The winners as a compact table (cells fold, never cut to an ellipsis, at any
    terminal width) and each winner's config as a line under it, as `report` prints them."""
    from rich import box
    from rich.text import Text

    from mla_tune.reports.table import config_text

    table = Table(title="winners", title_justify="left", box=box.SIMPLE_HEAD, padding=0)
    for col, numeric in (("shape", False), ("backend", False), ("median µs", True),
                         ("new", True), ("reused", True), ("side by side", True)):
        table.add_column(col, justify="right" if numeric else "left", overflow="fold")
    lines = []
    for r in results:
        w = r.winner
        new = sum(b.new_trials for b in r.backends)
        reused = sum(b.reused_trials for b in r.backends)
        together = str(r.side_by_side) if r.side_by_side else "-"
        cells = ((r.shape.label(), "-", "-") if w is None
                 else (r.shape.label(), w.backend, f"{w.median_us:.1f}"))
        table.add_row(*(Text(c) for c in (*cells, str(new), str(reused), together)))
        lines.append(f"  {r.shape.label()}: no correct variant" if w is None
                     else f"  {r.shape.label()} {w.backend}: {config_text(w.config)}")
    out.print(table)
    out.print("configs:", highlight=False)
    for line in lines:
        out.print(line, highlight=False)
    if any(r.side_by_side for r in results):
        console.print("side by side: finalists timed again in one interleaved run; each keeps "
                      "the better of its two timings", highlight=False, style="dim")
    skipped = {(b.name, b.skipped) for r in results for b in r.backends if b.skipped}
    for name, reason in sorted(skipped):
        console.print(f"skipped {name}: {reason}", highlight=False)
