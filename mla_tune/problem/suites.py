"""Named shape suites, declared in `configs/suites.toml`."""

from __future__ import annotations

import itertools
from typing import Any

from mla_tune.problem.shapes import KVFormat, RaggedLengths, Shape, ShapeError
from mla_tune.tuning.space import load_toml


class UnknownSuiteError(ValueError):
    pass


def _suites() -> dict[str, Any]:
    return load_toml("suites.toml").get("suites", {})


def suite_shapes(name: str, kv_formats: list[KVFormat] | None = None) -> list[Shape]:
    """The shapes of suite `name`; `kv_formats` overrides the formats the suite declares."""
    suites = _suites()
    if name not in suites:
        raise UnknownSuiteError(
            f"unknown suite {name!r}; known suites: {', '.join(suites) or '(none)'}")
    spec = suites[name]
    entries: list[dict[str, Any]] = list(spec.get("shapes", []))
    grid = spec.get("grid")
    if grid:
        keys = list(grid)
        for combo in itertools.product(*(grid[k] for k in keys)):
            entries.append(dict(zip(keys, combo)))
    shapes: list[Shape] = []
    for e in entries:
        formats = kv_formats or [KVFormat(e.get("kv_format", "bf16"))]
        for fmt in formats:
            shape = _entry_shape(name, e, fmt)
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def _entry_shape(suite: str, e: dict[str, Any], fmt: KVFormat) -> Shape:
    """One entry: uniform (`kv`) or a serving bucket's ragged batch (`ragged`, with
    `ragged_seed`; `kv`, when also given, caps the lengths)."""
    kw = dict(q_len=int(e.get("q_len", 1)), heads=int(e.get("heads", 16)), kv_format=fmt,
              page_size=int(e.get("page_size", 1)))
    try:
        if "ragged" in e:
            dist = RaggedLengths.parse(str(e["ragged"]), int(e.get("ragged_seed", 0)))
            cap = int(e["kv"]) if "kv" in e else None
            return Shape(int(e["batch"]), dist.draw(int(e["batch"]), cap), **kw)
        return Shape.uniform(int(e["batch"]), int(e["kv"]), **kw)
    except (KeyError, ShapeError) as exc:
        raise UnknownSuiteError(f"suite {suite!r}: bad entry {e}: {exc}") from None
