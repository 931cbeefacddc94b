"""Give results stored under the old kind of source hash the checkout's new one.

Kernel sources used to be hashed by their bytes, so a comment edit retired every result of
the kernel; they are now hashed by their code (mla_tune/source_hash.py). A stored source
whose hash equals the bytes hash of a backend's files here is this checkout's code under
its old name: `rehash` renames its trials, queued claims and winners to the backend's
current hash, so sweeps, dispatch and reports use them again instead of treating them as
retired (and `prune` would delete them once another source is measured).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mla_tune.db import RenamedRows, SourceRow, TuningStore


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
