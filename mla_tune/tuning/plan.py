"""What a sweep will measure, before anything runs: the backends usable on the device and
each shape's feasible candidates per backend. The sweep and `sweep --dry-run` both plan
with these functions, so the dry run lists what the sweep measures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mla_tune.backends.base import Backend
from mla_tune.problem.shapes import Shape

Pins = Mapping[str, Mapping[str, list[Any]]]


def available_backends(backends: Sequence[Backend], device: torch.device
                       ) -> tuple[list[Backend], dict[str, str]]:
    """The backends that can run on `device`, and why each other one cannot."""
    usable: list[Backend] = []
    skipped: dict[str, str] = {}
    for b in backends:
        avail = b.available(device)
        if avail:
            usable.append(b)
        else:
            skipped[b.name] = avail.reason
    return usable, skipped


def shape_candidates(backend: Backend, shape: Shape, device: torch.device,
                     pins: Pins) -> list[dict[str, Any]] | str:
    """The configs `backend` offers for `shape` (narrowed by its `pins`), or why it cannot
    run the shape at all."""
    reason = backend.supports(shape)
    if reason:
        return reason
    return backend.candidates(shape, device, pins.get(backend.name))


@dataclass(frozen=True)
class SweepPlan:
    """Candidate counts per shape and usable backend (None: the backend cannot run the
    shape), and the backends left out with their reasons."""

    backends: tuple[str, ...]
    rows: tuple[tuple[Shape, tuple[int | None, ...]], ...]
    skipped: dict[str, str]

    @property
    def total(self) -> int:
        return sum(n for _, counts in self.rows for n in counts if n is not None)


def plan_sweep(shapes: Sequence[Shape], backends: Sequence[Backend], device: torch.device,
               pins: Pins) -> SweepPlan:
    """The plan of a sweep of `shapes` over `backends` on `device`."""
    usable, skipped = available_backends(backends, device)
    names = tuple(b.name for b in backends)
    rows = []
    for shape in shapes:
        counts: list[int | None] = []
        for b in backends:
            if b not in usable:
                counts.append(None)
                continue
            cands = shape_candidates(b, shape, device, pins)
            counts.append(None if isinstance(cands, str) else len(cands))
        rows.append((shape, tuple(counts)))
    return SweepPlan(names, tuple(rows), skipped)
