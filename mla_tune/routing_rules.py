"""The dispatcher's pure routing rules, in the standard library alone.

`mla_tune.dispatch` imports these, and `mla-tune export --submission` copies this file's
source verbatim into the one-file leaderboard submission, so the installed dispatcher and
an exported file route a call by the same code: the key of a call from its `config`, the
nearest tuned shape, the occupancy model for untuned shapes, the split count a heuristic
takes among the candidates, and the KV format a call runs in. Nothing here may import
mla_tune, torch or triton (tests/test_export_submission.py checks it).
"""

from __future__ import annotations

import hashlib
import json
import math

CALL_KEY_FIELDS = ("batch_size", "q_seq_len", "kv_seq_len", "num_heads")
"""The task `config` fields that key a call: no tensor is read, nothing synchronizes."""

FORMAT_NAMES = ("bf16", "fp8", "mxfp4")
"""KV formats in the order a call without tuned data tries them."""


def call_key(config: dict) -> tuple:
    """The routing key of a call, `(batch, q_len, kv_len, heads)` from its `config`."""
    return tuple(config[f] for f in CALL_KEY_FIELDS)


def shape_key(batch: int, kv_lens: tuple, q_len: int, heads: int, kv_format: str,
              page_size: int = 1) -> str:
    """The stable text key of a shape (the DB's `shape_key`, `Shape.key`)."""
    if len(set(kv_lens)) > 1:
        digest = hashlib.sha1(",".join(map(str, kv_lens)).encode()).hexdigest()[:10]
        kv = f"kvr{sum(kv_lens) // batch}-{digest}"
    else:
        kv = f"kv{kv_lens[0]}"
    return f"b{batch}-q{q_len}-{kv}-h{heads}-{kv_format}-p{page_size}"


def nearest_distance(batch: int, kv_len: int, tuned_batch: int,
                     tuned_kv_len: int) -> tuple[float, int, int]:
    """Sort key of a tuned uniform shape for a call of `batch` x `kv_len` (its longest
    length when ragged): distance over (log batch, log kv length), ties to the smaller
    tuned shape."""
    return (math.hypot(math.log(tuned_batch) - math.log(batch),
                       math.log(tuned_kv_len) - math.log(kv_len)), tuned_batch, tuned_kv_len)


def occupancy_splits(batch: int, rows: int, kv_len: int, units: int, *,
                     rows_per_block: int = 16, overhead_tokens: float = 84.1,
                     max_splits: int = 16, min_split_tokens: int = 32) -> int:
    """Default KV split count for an untuned shape, after seed 000's
    `_compute_custom_splits`: maximize wave utilization (`batch * ceil(rows /
    rows_per_block) * splits` programs over `units` SMs) times split efficiency (`kv_len /
    (kv_len + overhead_tokens * splits)`, each split costing a fixed overhead), never
    cutting a split below `min_split_tokens` keys."""
    blocks = batch * -(-rows // rows_per_block)
    best, best_score = 1, -1.0
    for s in range(1, max_splits + 1):
        if s > 1 and kv_len < s * min_split_tokens:
            break
        total = blocks * s
        waves = -(-total // units)
        score = total / (waves * units) * kv_len / (kv_len + overhead_tokens * s)
        if score > best_score:
            best, best_score = s, score
    return best


def closest_splits(candidate_splits: list, want: int, suspect: list | None = None) -> int:
    """Index of the candidate whose `num_splits` is nearest `want` in log2 (0 = auto is
    never nearest), the first on ties, unsuspected ones (`suspect[i]` false) before any
    suspected: the heuristic's pick among a family's candidates."""
    def gap(i: int) -> tuple[bool, float, int]:
        n = int(candidate_splits[i])
        return (bool(suspect and suspect[i]),
                abs(math.log2(n) - math.log2(want)) if n > 0 else math.inf, i)

    return min(range(len(candidate_splits)), key=gap)


def format_rank(reason: str | None, tuned_us: float | None, total_kv: int,
                tuned_total_kv: int | None, kv_format: str) -> tuple[int, float, int]:
    """Sort key of a KV format for a call: formats with an exact winner first, then those
    with a nearest tuned shape, each by its tuned median scaled by the ratio of KV tokens
    (decode is memory-bound); formats without tuned data last, in `FORMAT_NAMES` order.
    `reason` is "exact", "nearest" or None (no tuned shape)."""
    order = FORMAT_NAMES.index(kv_format)
    if reason is None or tuned_us is None or not tuned_total_kv:
        return (2, math.inf, order)
    return (0 if reason == "exact" else 1, tuned_us * total_kv / tuned_total_kv, order)


def config_text(config: dict) -> str:
    """Canonical JSON text of a config (`mla_tune.space.config_key`)."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


def trust_tier(key: str, family: tuple, ok: frozenset | set, wrong: frozenset | set,
               wrong_family: dict) -> tuple[int, str] | None:
    """How far a variant can be trusted at shape `key` (of shape family `family`: format,
    heads, q_len, page size), from the shape keys it was verified ok / stored wrong at and
    one wrong shape's label per family: None if stored wrong here (never run it there),
    else (tier, why): 0 verified here, 1 never verified here, 2 suspect (wrong at another
    shape of its family). A wrong shape is its label or an object with `.label()`."""
    if key in wrong:
        return None
    if key in ok:
        return 0, "verified at this shape"
    bad = wrong_family.get(family)
    if bad is not None:
        label = bad if isinstance(bad, str) else bad.label()
        return 2, f"suspect: stored wrong at {label}; never verified at this shape"
    return 1, "never verified at this shape"
