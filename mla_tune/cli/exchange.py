"""`mla-tune export` and `import`: the winners JSON file and the one-file submission."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from mla_tune.cli.common import DB_HELP, app, console, fail, open_store, tuning_shapes
from mla_tune.problem.shapes import KVFormat


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
    from mla_tune.results.winners_file import export_winners

    if (out_path is None) == (submission is None):
        fail("give exactly one of --out FILE.json (winners JSON) or --submission FILE.py")
    target = out_path if out_path is not None else submission
    assert target is not None
    if target.is_dir() or not target.absolute().parent.is_dir():
        fail(f"{'--out' if out_path else '--submission'} {target}: give a file path in an "
             "existing directory")
    if out_path is not None and (suite or shape or leaderboard or gpu):
        fail("--suite, --shape, --leaderboard and --gpu apply to --submission only")
    shapes = tuning_shapes(shape, suite, [KVFormat.BF16], heads, q_len, 1) if (suite or shape) else []
    store = open_store(db, read_only=True)
    device_hash = None
    if device is not None:
        from mla_tune.machine.fingerprint import resolve_hash_prefix

        try:
            device_hash = resolve_hash_prefix(device, [d.hash for d in store.devices()],
                                              "device")
        except ValueError as exc:
            fail(f"{exc} (in {store.url})")
    if submission is not None:
        from mla_tune.runtime.submission_export import SubmissionError, write_submission

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
    replace_timings: bool = typer.Option(False, "--replace-timings", help="The file's times supersede those stored for its winners' shapes (same device, backend and kernel sources, any stack), e.g. a re-timing under another protocol: their timed trials are deleted first, failed and wrong ones kept."),
) -> None:
    """Add the winners of a JSON file to the DB; each competes with the trials already there
    (or, with --replace-timings, with none of that shape's timings)."""
    from mla_tune.results.winners_file import WinnersFileError, import_winners, load_winners_json

    try:
        records = load_winners_json(path)  # validated before the DB is opened or written
    except (OSError, WinnersFileError) as exc:
        fail(f"cannot import {path}: {exc}")
    store = open_store(db)
    s = import_winners(store, path, records, replace_timings=replace_timings)
    console.print(f"imported {s.trials} winners into {store.url}: {s.won} now win their "
                  f"shape; {s.not_current} kept as trials only (backend unknown here or "
                  "kernel sources differ)")
