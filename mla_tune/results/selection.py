"""Which trial wins a shape: the fastest correct trial of the current kernel sources.

This is policy, kept out of the DB layer: the store hands over a shape's candidate trials
and stores the choice made here in the same transaction (`BaseTuningStore.replace_winner`),
so concurrent sweeps never store a winner chosen from a stale view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mla_tune.db import BaseTuningStore, TrialRow
from mla_tune.results.winner import Winner


def fastest_correct(candidates: Sequence[TrialRow]) -> TrialRow | None:
    """The 'ok' trial with the lowest median; a tie goes to the earlier trial (lower id), so
    re-running a selection never changes a winner between equal times. None when no trial
    is 'ok'."""
    ok = [t for t in candidates if t.status == "ok" and t.median_us is not None]
    return min(ok, key=lambda t: (t.median_us, t.id), default=None)


def update_winner(store: BaseTuningStore, device_id: int, software_id: int, shape_key: str,
                  current_sources: Mapping[str, str]) -> Winner | None:
    """Recompute and store the winner of a shape from its trials.

    `current_sources` maps every backend that may win to its current source hash; trials of
    other backends or of retired sources never win. When no trial qualifies the stored
    winner is removed (it would point at sources that no longer exist) and None returned."""
    return store.replace_winner(device_id, software_id, shape_key, current_sources,
                                fastest_correct)
