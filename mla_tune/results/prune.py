"""Drop what no sweep, report or dispatch of this checkout will read again: the trials,
queued work and Optuna studies of kernel sources that have been retired.

A backend's source is retired when it is neither the checkout's (what `source_hashes`
computes from the kernel files here) nor the newest one measured in the DB (so results of
kernels edited since their sweep, or of backends this machine cannot load, survive).
Trials a stored winner points at are kept with their winner. Every re-sweep of an edited
kernel leaves its predecessor's trials and studies behind, which is most of a long-lived
DB's size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mla_tune.db import BaseTuningStore, DeletedRows, SourceRow
from mla_tune.tuning.optuna_study import delete_studies, study_sources


@dataclass(frozen=True)
class RetiredSource:
    """One retired (backend, source): the trials and studies of it that a prune deletes
    (trials that winners name are not counted: they stay)."""

    backend: str
    source_hash: str
    trials: int
    studies: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PruneResult:
    """What a prune removed."""

    rows: DeletedRows
    studies: int


def plan(sources: list[SourceRow], studies: Mapping[str, tuple[str, str]],
         current: Mapping[str, str]) -> list[RetiredSource]:
    """The retired sources among those with trials (`sources`) or studies (`studies`),
    given the checkout's `current` source per backend."""
    keep = {(b, h) for b, h in current.items()}
    newest: dict[str, SourceRow] = {}
    for row in sources:
        if row.backend not in newest or row.newest_trial_id > newest[row.backend].newest_trial_id:
            newest[row.backend] = row
    keep |= {(r.backend, r.source_hash) for r in newest.values()}
    trials = {(r.backend, r.source_hash): r.trials - r.named_by_winners for r in sources}
    named: dict[tuple[str, str], list[str]] = {}
    for name, pair in studies.items():
        named.setdefault(pair, []).append(name)
    pairs = sorted((set(trials) | set(named)) - keep)
    retired = [RetiredSource(b, h, trials.get((b, h), 0), sorted(named.get((b, h), [])))
               for b, h in pairs]
    return [r for r in retired if r.trials or r.studies]


def find_retired(store: BaseTuningStore, current: Mapping[str, str]) -> list[RetiredSource]:
    """The retired sources in `store`, their trials and studies."""
    return plan(store.sources(), study_sources(store.optuna_storage()), current)


def retired_trials(store: BaseTuningStore, current: Mapping[str, str]) -> int:
    """How many trials a prune would delete; reads our tables only, so it works on a store
    opened read-only (Optuna's storage may create its tables)."""
    return sum(r.trials for r in plan(store.sources(), {}, current))


def prune(store: BaseTuningStore, retired: list[RetiredSource]) -> PruneResult:
    """Delete the studies of `retired`, then its trials and claims (one transaction), then
    compact the file. An interrupted prune leaves only retired rows, which the next one
    finds again."""
    studies = delete_studies(store.optuna_storage(), [n for r in retired for n in r.studies])
    rows = store.delete_sources([(r.backend, r.source_hash) for r in retired])
    store.compact()
    return PruneResult(rows, studies)


def unrenamed_trials(store: BaseTuningStore, pairs: Mapping[str, tuple[str, str]]) -> int:
    """Trials of this checkout's code still under its old (bytes) hash (`pairs`:
    `backends.source_hash_pairs()`): a prune must wait for `rehash`, or it would delete
    them as retired."""
    from mla_tune.results.rehash import find

    return sum(r.trials for r in find(store, pairs))
