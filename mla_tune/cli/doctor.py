"""`mla-tune doctor`: device, versions, usable backends and stored winners."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.table import Table

from mla_tune.cli.common import DB_HELP, app, fail, out
from mla_tune.tuning.devices import default_device

if TYPE_CHECKING:
    from mla_tune.results.rehash import OffSource


@app.command()
def doctor(device: str | None = typer.Option(None, help="cuda or cpu."),
           db: str | None = typer.Option(None, help=DB_HELP)) -> None:
    """Device, versions, which backends are available (and why not), and how many stored
    winners the dispatcher would use here."""
    import torch

    from mla_tune.backends import backend_names, get_backend
    from mla_tune.db import resolve_url
    from mla_tune.machine.fingerprint import current_device, current_software
    from mla_tune.runtime.dispatcher import Dispatcher

    try:
        dev = torch.device(device or default_device())
        fp = current_device(dev)
    except (RuntimeError, ValueError) as exc:
        fail(f"cannot use device {device!r}: {exc}; use cpu, cuda or cuda:N")
    out.print(f"device: {fp.name} ({fp.vendor}, {fp.arch}, {fp.sm_count} SMs/cores, "
              f"{fp.memory_bytes / 2**30:.1f} GiB) fingerprint {fp.hash}")
    sw = current_software()
    out.print("software: " + ", ".join(f"{k} {v}" for k, v in sw.versions))
    out.print(f"tuning DB: {resolve_url(db).render_as_string(hide_password=True)}")
    out.print(f"winners usable here: {Dispatcher.from_db(db, dev).summary()}", highlight=False)
    off_source, stale, retired = _stored_sources(db)
    for off in off_source:
        out.print(f"{off.winners} stored {off.backend} winners are of other kernel code "
                  f"(source {off.stored}; this checkout's is {off.current}): the dispatcher "
                  "ignores them. If the change kept every stored kernel (same compiled "
                  f"code), `mla-tune rehash --source {off.backend}={off.stored} --yes` "
                  "re-keys them; otherwise re-sweep those shapes", highlight=False)
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


def _stored_sources(db: str | None) -> tuple[list[OffSource], int, int]:
    """What the DB holds of kernel code other than this checkout's, from one read: winners
    the dispatcher ignores, trials `rehash` would rename and trials `prune` would delete
    (read-only; nothing when the DB cannot be read)."""
    from mla_tune.backends import source_hash_pairs
    from mla_tune.db import DBError, TuningStore
    from mla_tune.results.prune import retired_trials, unrenamed_trials
    from mla_tune.results.rehash import off_source_winners

    pairs = source_hash_pairs()
    try:
        with TuningStore(db, read_only=True) as store:
            return (off_source_winners(store.winners(), pairs),
                    unrenamed_trials(store, pairs),
                    retired_trials(store, {b: new for b, (_, new) in pairs.items()}))
    except DBError:
        return [], 0, 0
