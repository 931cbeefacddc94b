"""`mla-tune prune` and `rehash`: retire and re-key stored kernel sources."""

from __future__ import annotations

import typer

from mla_tune.cli.common import DB_HELP, app, console, existing_store, fail, listing


@app.command()
def prune(
    db: str | None = typer.Option(None, help=DB_HELP),
    yes: bool = typer.Option(False, "--yes", help="Delete them; without it, only list them."),
) -> None:
    """Delete trials, queued work and search studies of retired kernel sources (neither this
    checkout's nor the newest measured); winners and the trials they name stay."""
    from mla_tune.backends import source_hash_pairs
    from mla_tune.db import sqlite_file_size
    from mla_tune.results.prune import find_retired
    from mla_tune.results.prune import prune as prune_sources
    from mla_tune.results.prune import unrenamed_trials

    store = existing_store(db)
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
    console.print(listing(f"retired kernel sources in {store.url}",
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
    from mla_tune.results.rehash import GitRevisionError, find, git_hash_pairs
    from mla_tune.results.rehash import rehash as rehash_sources

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
            pairs = git_hash_pairs(from_git, source_files(), source_hashes())
        except GitRevisionError as exc:
            fail(str(exc))
        old_name = f"their hash at {from_git}"
    else:
        pairs, old_name = source_hash_pairs(), "their bytes hash"
    store = existing_store(db)
    rekeys = find(store, pairs)
    if not rekeys:
        console.print(f"nothing to rehash in {store.url}: no stored source is this "
                      f"checkout's code under {old_name}")
        return
    console.print(listing(f"sources of this checkout stored under {old_name} in "
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
