"""Give results stored under an old name of this checkout's kernel code its current one.

Kernel sources used to be hashed by their bytes, so a comment edit retired every result of
the kernel; they are now hashed by their code (mla_tune/backends/source_hash.py). A stored source
whose hash equals the bytes hash of a backend's files here is this checkout's code under
its old name: `rehash` renames its trials, queued claims and winners to the backend's
current hash, so sweeps, dispatch and reports use them again instead of treating them as
retired (and `prune` would delete them once another source is measured).

The other old name is the code hash of the same files at an earlier git revision
(`git_hash_pairs`): after a change that keeps what every stored variant runs (files
moved, imports rewritten, glue refactored, a kernel mode added whose default compiles to
the same binaries), the maintainer re-keys that revision's results to the current code.
That is a claim about the change, not a proof the tool makes: use it only with the
evidence (identical compiled kernels, unchanged launch rules), never after a kernel edit
that may change a result.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mla_tune.backends.source_hash import hash_named_sources
from mla_tune.db import RenamedRows, SourceRow, TuningStore
from mla_tune.results.winner import Winner


@dataclass(frozen=True)
class Rekey:
    """One stored source to rename: `trials` of `backend` stored under `old`, the bytes
    hash of the checkout's files, which now hash to `new`."""

    backend: str
    old: str
    new: str
    trials: int


def plan(sources: list[SourceRow], hashes: Mapping[str, tuple[str, str]]) -> list[Rekey]:
    """The stored sources (`sources`) that are a backend's checkout code under its bytes
    hash, given (bytes hash, code hash) per backend (`backends.source_hash_pairs`)."""
    rekeys = []
    for row in sources:
        old, new = hashes.get(row.backend, ("", ""))
        if row.source_hash == old and old != new:
            rekeys.append(Rekey(row.backend, old, new, row.trials))
    return rekeys


def find(store: TuningStore, hashes: Mapping[str, tuple[str, str]]) -> list[Rekey]:
    """The sources of `store` to rename (reads our tables only: works read-only)."""
    return plan(store.sources(), hashes)


def rehash(store: TuningStore, rekeys: list[Rekey]) -> list[RenamedRows]:
    """Rename each planned source (one transaction per source)."""
    return [store.rename_source(r.backend, r.old, r.new) for r in rekeys]


@dataclass(frozen=True)
class OffSource:
    """`winners` of `backend` stored under `stored`, a source hash that is neither name of
    this checkout's code (`current` is its code hash): the dispatcher ignores them here."""

    backend: str
    stored: str
    current: str
    winners: int


def off_source_winners(winners: list[Winner],
                       hashes: Mapping[str, tuple[str, str]]) -> list[OffSource]:
    """Stored winners of loadable backends (`hashes`: backend -> (bytes hash, code hash),
    `source_hash_pairs`) whose kernel code is not this checkout's, per (backend, stored
    hash). Nothing but these rows says that tuned routes went missing: a kernel edit makes
    the dispatcher drop them without an error, until they are re-keyed (when the edit kept
    every stored kernel) or re-swept."""
    counts: dict[tuple[str, str], int] = {}
    for w in winners:
        if w.backend in hashes and w.source_hash not in hashes[w.backend]:
            key = (w.backend, w.source_hash)
            counts[key] = counts.get(key, 0) + 1
    return [OffSource(b, h, hashes[b][1], n) for (b, h), n in sorted(counts.items())]


class GitRevisionError(ValueError):
    """A revision whose files cannot be read (not a git checkout, unknown revision)."""


def git_hash_pairs(rev: str, files: Mapping[str, list[Path]],
                   current: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """(hash of the backend's files as they were at git `rev`, current hash) per backend of
    `files` (its current source paths) whose files all existed at `rev` under the same
    repository paths, hashed as the backends hash their files."""
    out: dict[str, tuple[str, str]] = {}
    for backend, paths in files.items():
        blobs = []
        for p in paths:
            data = _git_show(rev, p)
            if data is None:
                break
            blobs.append((p.name, data))
        else:
            out[backend] = (hash_named_sources(blobs), current[backend])
    return out


def _git_show(rev: str, path: Path) -> bytes | None:
    """The bytes of `path` at `rev` (None if it did not exist there)."""
    path = path.resolve()
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path.parent,
                             capture_output=True, check=True, text=True).stdout.strip()
        subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                       cwd=top, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        raise GitRevisionError(f"cannot read revision {rev!r}: {path.parent} is not in a git "
                               "checkout, or the revision is unknown there") from None
    rel = path.relative_to(Path(top).resolve()).as_posix()
    r = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=top, capture_output=True)
    return r.stdout if r.returncode == 0 else None
