"""The length-bucket rules of ragged decode calls, in the standard library alone.

`mla_tune.runtime.buckets` (the dispatcher's bucket routing and runners) is built on these, and
`mla-tune export --submission` copies this file's source verbatim into the one-file
leaderboard submission, so both put a ragged call in the same bucket, route it as the same
representative shape and adapt a tuned config the same way: which kv class a mean length
falls in, the class's representative length, what makes a config length-independent, and
which task tuples can only be ragged. Its imports are the standard library's alone
(tests/runtime/test_submission_export.py checks it).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

KV_BUCKETS_ENV = "MLA_TUNE_KV_BUCKETS"
"""Environment variable with the kv class edges, e.g. "256,1024,4096"."""

DEFAULT_KV_EDGES = tuple(2 ** k for k in range(6, 21))
"""Upper edges of the kv classes: the powers of two 64 .. 1048576."""

BUCKET_BACKENDS = ("triton", "torch")
"""Families with a bucket build (a runner that reads lengths on the device)."""


def check_kv_edges(edges: Any) -> tuple[int, ...]:
    """`edges` as ascending positive ints, or ValueError saying what is wrong."""
    try:
        out = tuple(int(e) for e in edges)
    except (TypeError, ValueError):
        raise ValueError(f"kv bucket edges must be ascending positive ints, got {edges!r}"
                         ) from None
    if not out or any(e < 1 for e in out) or list(out) != sorted(set(out)):
        raise ValueError(f"kv bucket edges must be ascending positive ints, got {edges!r}")
    return out


def parse_kv_edges(text: str) -> tuple[int, ...]:
    """`"256,1024,4096"` -> edges (what `MLA_TUNE_KV_BUCKETS` holds)."""
    try:
        return check_kv_edges(int(p) for p in text.replace(" ", "").split(",") if p)
    except ValueError as e:
        raise ValueError(f"{KV_BUCKETS_ENV}: {e}; expected ascending ints like "
                         "'256,1024,4096'") from None


def kv_edges_from_env(environ: Mapping[str, str]) -> tuple[int, ...]:
    """The edges `environ` names (`MLA_TUNE_KV_BUCKETS`), else `DEFAULT_KV_EDGES`."""
    text = environ.get(KV_BUCKETS_ENV, "").strip()
    return parse_kv_edges(text) if text else DEFAULT_KV_EDGES


def kv_class(edges: tuple[int, ...], mean_kv: float) -> tuple[int, int]:
    """(lower edge exclusive, upper edge inclusive) of the class holding `mean_kv`; past
    the last edge, classes keep doubling."""
    i = bisect.bisect_left(edges, math.ceil(mean_kv))
    if i < len(edges):
        return (edges[i - 1] if i else 0), edges[i]
    hi = edges[-1]
    while hi < mean_kv:
        hi *= 2
    return hi // 2, hi


def rep_len(kv_lo: int, kv_hi: int, q_len: int) -> int:
    """A class's representative length: the geometric middle of (kv_lo, kv_hi] (of
    (kv_hi / 2, kv_hi] for the first class), at least `q_len`."""
    lo = kv_lo if kv_lo > 0 else max(kv_hi // 2, 1)
    return max(q_len, round(math.sqrt(lo * kv_hi)))


def winner_pages(page_size: int) -> tuple[int, ...]:
    """The page sizes whose tuned winners a bucket of `page_size` takes, in order: its own,
    then the contiguous (page 1) ones, made length-independent by `bucket_config`. So a
    paged bucket without a ragged winner of its page size takes the contiguous bucket's
    ragged winner before any uniform winner, as its uniform lookup takes its own page
    size's winners before the contiguous ones."""
    return (page_size, 1) if page_size != 1 else (1,)


def bucket_config(backend: str, config: Mapping[str, Any]) -> dict[str, Any] | None:
    """`config` made independent of the lengths, or None when the family has no bucket
    build: Triton's `kv_load='tma_host'` needs every length a multiple of the tile and
    runs as `'tma'` (per-program descriptors, the same tiles); from a page pool the
    runner takes TMA tiles where a tile lies inside a page and pointer loads otherwise
    (BalancedLauncher); the page-size knob is 1 (contiguous: direct rows, since a
    page table from the knob would fix the lengths; paged: the call's own page size,
    which the shape carries). Every other knob is kept: `seg_cost` is the bucket
    runner's own (the balanced schedule's setup charge per sequence)."""
    if backend not in BUCKET_BACKENDS:
        return None
    out = dict(config)
    if backend == "triton":
        if out.get("kv_load") == "tma_host":
            out["kv_load"] = "tma"
        out["page_size"] = 1
    return out


def is_ragged_rows(rows: int, batch: int, q_len: int, kv_max: int) -> bool:
    """Whether a task tuple of `rows` KV rows can only be a ragged batch: fewer than
    `batch * kv_max` rows, and at least one sequence of `kv_max` (the longest, as the
    config says) plus `q_len` for each other one."""
    return kv_max + (batch - 1) * q_len <= rows < batch * kv_max
