"""`mla-tune route`: which variant a call of a given shape would run, and why, without
running or building anything. Kept out of cli.py so the dispatcher's dependencies load
only when this command runs."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console

from mla_tune.cli.common import DB_HELP
from mla_tune.problem.shapes import KVFormat, Shape, ShapeError, parse_shape

# Configs and file names are printed as they are: no markup, no :emoji: codes.
_out = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)


def route(
    shape: str = typer.Option(..., "--shape", "-s", help="BATCHxKV, e.g. 4x1024."),
    kv_format: str = typer.Option("auto", "--kv-format", "-f",
                                  help="bf16, fp8, mxfp4, or auto (the dispatcher's policy "
                                       "over all three)."),
    heads: int = typer.Option(16, help="Query heads."),
    q_len: int = typer.Option(1, "--q-len", help="Query tokens per sequence (1-4)."),
    serving: bool = typer.Option(False, "--serving", help="Route a serving call of BATCH "
                                 "sequences whose lengths average KV instead: its length "
                                 "bucket and the variant the bucket's runner builds (a ragged "
                                 "task tuple; with --page-size, MLADecodeWrapper's page pool)."),
    page_size: int | None = typer.Option(None, "--page-size", min=1, help="KV page size of "
                                         "the call (default 1; with --serving: route the "
                                         "wrapper's page pool of this page size)."),
    db: str | None = typer.Option(None, help=DB_HELP),
    winners: str | None = typer.Option(None, help="Route from this winners JSON file "
                                                  "instead of the DB."),
    device: str | None = typer.Option(None, help="cuda or cpu (default: cuda when present)."),
) -> None:
    """Print which variant a call of this shape would run, why, and what it falls back to."""
    import torch

    from mla_tune.cli.common import fail
    from mla_tune.runtime.dispatcher import FORMAT_ORDER, Dispatcher

    try:
        base = parse_shape(shape, q_len=q_len, heads=heads, page_size=page_size or 1)
        fmt = None if kv_format.strip().lower() == "auto" else KVFormat.parse(kv_format)
    except (ShapeError, ValueError) as e:
        fail(str(e))
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda was asked for but torch sees no GPU; use --device cpu")
    try:
        d = (Dispatcher.from_json(winners, device) if winners
             else Dispatcher.from_db(db, device))
    except ValueError as e:  # a bad MLA_TUNE_FORCE, or a device that cannot be used
        fail(str(e))
    _out.print(f"table: {d.summary()}")
    formats = [fmt] if fmt is not None else list(FORMAT_ORDER)
    if serving:
        _route_buckets(d, base, formats, paged=page_size is not None)
        return
    for f in formats:
        chain = d.decisions(base.with_format(f))
        _print_chain(chain[0].shape.label(), chain)
    if fmt is None:
        chosen = d.choose_format(base, [f.value for f in FORMAT_ORDER])
        _out.print(f"a task call holding all formats runs {chosen.value} (fastest exact "
                   "winner, else nearest-shape estimate; untuned formats rank bf16, fp8, "
                   "mxfp4)")


def _cfg(config: dict[str, object]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(config.items()))


def _print_chain(head: str, chain: list[Any]) -> None:
    """A route's decisions: what runs, why, and what it falls back to."""
    first = chain[0]
    _out.print(f"{head}: {first.backend} {_cfg(first.config)}")
    _out.print(f"  why: {first.reason}: {first.detail}")
    for alt in chain[1:]:
        _out.print(f"  if that fails: {alt.backend} {_cfg(alt.config)} ({alt.reason})")


def _route_buckets(d: Any, base: Shape, formats: list[KVFormat], paged: bool) -> None:
    """What a serving call's bucket runs: the route `MLADecodeWrapper.plan` (paged) or a
    ragged task tuple (contiguous) takes for these host-side sizes, per format."""
    from mla_tune.runtime.buckets import KV_BUCKETS_ENV, router_for

    router = router_for(d)
    call = (f"MLADecodeWrapper, pages of {base.page_size}" if paged
            else "ragged task tuple, contiguous KV")
    _out.print(f"length buckets: kv edges {', '.join(map(str, router.edges.kv))} "
               f"(${KV_BUCKETS_ENV} sets them); a call routes by its mean length")
    for f in formats:
        bucket = router.bucket(base.batch, base.total_kv, base.q_len, base.heads, f,
                               base.page_size)
        _print_chain(f"bucket {bucket.label()} ({call})", router.decisions(bucket, paged))
