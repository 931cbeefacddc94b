"""`mla-tune diff`: winners and times of two DBs or stacks, side by side."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from mla_tune.cli.common import DB_HELP, app, fail, open_store, out

_STACK_HASH = re.compile(r"[0-9a-f]{4,64}")


def _diff_side(ref: str, db: str | None) -> Any:
    """A DB (URL or existing file) or a software stack hash prefix of `db`."""
    from mla_tune.reports.diff import DiffSide

    if _STACK_HASH.fullmatch(ref) and not Path(ref).exists():
        from mla_tune.machine.fingerprint import resolve_hash_prefix

        store = open_store(db, read_only=True)
        try:
            stack = resolve_hash_prefix(ref, [w.software.hash for w in store.winners()],
                                        "software stack")
        except ValueError as exc:
            fail(f"{exc} (stacks with winners in {store.url})")
        return DiffSide.load(store, f"stack {stack[:8]}", stack)
    if "://" not in ref and not Path(ref).is_file():
        fail(f"{ref!r} is neither a tuning DB file nor a software stack hash of --db; give a "
             "DB path or URL, or a hash from `mla-tune report --format json`")
    return DiffSide.load(open_store(ref, read_only=True), ref)


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
    from mla_tune.reports.diff import DEFAULT_MIN_CHANGE, compare, stack_changes, summarize_diff

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
    from mla_tune.reports.diff import STATUSES

    counts = {s: sum(d.status == s for d in rows) for s in STATUSES}
    out.print(", ".join(f"{n} {s}" for s, n in counts.items()), highlight=False)
