"""Which of a shape's trials a sweep times again, side by side, before it picks the winner.

A sweep times its candidates one after another. On a GPU, identical code can run 5-10 %
slower for seconds at a time (on the H200: docs/design/runoff.md), so
which of two close finalists timed at different moments wins is partly chance, and a
winner's stored time depends on the moment it was timed. The finalists are timed again in
one interleaved run (`Timer.measure_interleaved`), at one moment for all of them, and each
keeps the better of its two timings (`TuningStore.record_remeasure`): a finalist is then
slow only if both of its moments were.
"""

from __future__ import annotations

from collections.abc import Sequence

from mla_tune.db import TrialRow
from mla_tune.problem.shapes import KVFormat, Shape

DEFAULT_FINALISTS = 3
WINDOW = 0.15
"""Finalists are within this fraction of the fastest first time; slower ones cannot win."""


def finalists(trials: Sequence[TrialRow], k: int = DEFAULT_FINALISTS) -> list[TrialRow]:
    """The `k` fastest 'ok' trials within WINDOW of the fastest, then the fastest of each
    other backend (the baselines a report compares the winner with), fastest first. Empty
    when that leaves fewer than two trials or `k` < 2: there is nothing to compare."""
    ok = sorted(((t.median_us, t.id, t) for t in trials
                 if t.status == "ok" and t.median_us is not None), key=lambda x: x[:2])
    if k < 2 or len(ok) < 2:
        return []
    limit = ok[0][0] * (1.0 + WINDOW)
    chosen = [t for us, _, t in ok[:k] if us <= limit]
    for _, _, t in ok:
        if t.backend not in {c.backend for c in chosen}:
            chosen.append(t)
    return chosen if len(chosen) >= 2 else []


def timed_together(trials: Sequence[TrialRow]) -> bool:
    """Whether these trials' times already come from one side-by-side run."""
    stamps = {t.remeasured_at for t in trials}
    return len(stamps) == 1 and None not in stamps


def timed_with(trials: Sequence[TrialRow], trial_id: int | None) -> int:
    """How many of `trials` were timed in one side-by-side run with trial `trial_id`, it
    included; 0 when that trial was never timed again."""
    stamp = next((t.remeasured_at for t in trials if t.id == trial_id), None)
    return 0 if stamp is None else sum(1 for t in trials if t.remeasured_at == stamp)


def call_of(shape: Shape) -> str:
    """The key of a shape's call whatever its KV format: a sweep runs off the shapes of one
    call together, since the dispatcher picks a call's format from its winners' times."""
    return shape.with_format(KVFormat.BF16).key


def call_finalists(trials_by_shape: Sequence[Sequence[TrialRow]],
                   k: int = DEFAULT_FINALISTS) -> list[TrialRow]:
    """The finalists of a call swept in one or more KV formats: each shape's `finalists`;
    beside other formats, a shape with a single correct trial sends that one (its format's
    winner)."""
    out: list[TrialRow] = []
    for trials in trials_by_shape:
        chosen = finalists(trials, k)
        if not chosen and len(trials_by_shape) > 1:
            ok = [t for t in trials if t.status == "ok" and t.median_us is not None]
            chosen = [min(ok, key=lambda t: (t.median_us, t.id))] if ok else []
        out += chosen
    return out
