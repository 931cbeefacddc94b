"""The dispatcher's pure routing rules, in the standard library alone.

`mla_tune.runtime.dispatcher` imports these, and `mla-tune export --submission` copies this file's
source verbatim into the one-file leaderboard submission, so the installed dispatcher and
an exported file route a call by the same code: the key of a call from its `config`, the
nearest tuned shape, the occupancy model for untuned shapes, the split count a heuristic
takes among the candidates, and the KV format a call runs in. Nothing here may import
mla_tune, torch or triton (tests/runtime/test_submission_export.py checks it).

The row model. A program of a row-blocked family (a `block_m` knob: the Triton family)
covers `block_m` of a call's `q_len x heads` query rows and reads the whole KV tile for
them, so a call reads its KV once per row block: `row_block` takes the largest block the
rows fill. Its programs are `batch x ceil(rows / block_m) x splits`, spread over the SMs:
`occupancy_splits` counts them. A variant tuned at another shape (another batch, KV length,
q_len or heads) moves to a call with those two knobs re-derived (`model_knobs`: the block
from the rows, the split count from the occupancy model calibrated by the tuned shape's
own measured split count), every other knob kept as tuned where the call's feasible
candidates allow (`model_ranking`). The nearest tuned shape to move from is taken over
(log batch, log kv length, log rows) across q_len/heads families (`transfer_distance`):
on the H200 coverage grid a neighbouring family at the call's own batch and KV length is a
better guide than the call's family 8x away in batch or KV
(bench/results/coverage_and_fallbacks.md). The heuristic is the same model without a tuned
shape.
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


ROW_BLOCK_KNOB = "block_m"
"""The knob that makes a family row-blocked: the model re-derives it and `num_splits`."""

ROW_KNOBS = (ROW_BLOCK_KNOB, "num_warps", "num_splits")
"""Knobs that follow a call's rows and batch: re-derived by the model, never carried from a
tuned shape (the Triton family ties `num_warps` to `block_m`)."""


TRANSFER_TRIES = 3
"""Variants a moved tuned shape offers (best first), so one the precheck prunes (a spill
the shape arithmetic cannot see) falls to the next moved variant, not the heuristic."""

RUNTIME_KNOBS = ("num_splits", "fast_mode", "seg_cost")
"""Knobs that change no compiled kernel: alternatives that differ only in them would fail a
compile-time precheck alike (`distinct_variants`)."""


def distinct_variants(candidates: list, order: list, limit: int) -> list[int]:
    """The first `limit` indices of `order` whose candidates differ in some compiled knob
    (any but `RUNTIME_KNOBS`), so each fallback can get past what stopped the one before."""
    seen, out = set(), []
    for i in order:
        key = config_text({k: v for k, v in candidates[i].items() if k not in RUNTIME_KNOBS})
        if key not in seen:
            seen.add(key)
            out.append(i)
            if len(out) == limit:
                break
    return out


def row_block(rows: int, block_ms: list | tuple | set, source_rows: int | None = None,
              source_block_m: int | None = None) -> int:
    """The row block (`block_m`) for a call with `rows` query rows per sequence (q_len x
    heads), among the `block_ms` its candidates offer: the largest one the rows fill, so KV
    is read as few times as the choices allow (the smallest where none fits). A tuned
    source's block is kept at the source's own row count, and caps the pick where the
    source could have taken the larger block and measured a smaller one faster."""
    choices = sorted({int(b) for b in block_ms})
    fits = [b for b in choices if b <= rows]
    cap = fits[-1] if fits else choices[0]
    if source_block_m is None or source_rows is None:
        return cap
    if source_rows == rows and source_block_m in choices:
        return source_block_m
    if cap <= source_rows:
        below = [b for b in choices if b <= min(cap, source_block_m)]
        return below[-1] if below else choices[0]
    return cap


def auto_split_count(batch: int, rows: int, kv_len: int, block_m: int, block_n: int,
                     units: int) -> int:
    """The split count the Triton kernel takes for `num_splits = 0` (kernels/triton/
    mla_decode.auto_splits): about two waves of programs, within one split per KV tile."""
    programs = max(1, batch * -(-rows // block_m))
    return max(1, min(-(-2 * units // programs), -(-kv_len // block_n), 64))


def model_knobs(batch: int, rows: int, kv_len: int, units: int, block_ms: list | tuple | set,
                source: tuple | None = None, max_splits: int = 16) -> tuple[int, float]:
    """(block_m, split target) the row model wants for a call of `batch` sequences of
    `rows` query rows and (longest) `kv_len` keys on `units` SMs, splits up to
    `max_splits` (the candidates' largest). `source` is the tuned variant moved here: (its
    config, batch, rows, kv length). Its split count (automatic ones as the kernel resolves
    them there) is scaled by how the occupancy model's count moves from the source shape to
    the call: the model's trend, calibrated by a measurement. A count whose programs fill
    at most half a wave at the source is kept while they stay under one wave at the call:
    the tuner chose it for what each split costs, which the model's wave count does not
    see (on the H200, 16 splits won at 4x8192 and 8x8192 bf16 16 heads, where the model's
    trend halved them; a count filling a wave, 2 at 64x1024, follows the trend). The
    target may be fractional (`model_ranking` takes the nearest candidate in log2)."""
    def model(b: int, r: int, kv: int, bm: int) -> int:
        return occupancy_splits(b, r, kv, units, rows_per_block=bm, max_splits=max_splits)

    if source is None:
        bm = row_block(rows, block_ms)
        return bm, float(model(batch, rows, kv_len, bm))
    config, s_batch, s_rows, s_kv = source
    s_bm = int(config.get(ROW_BLOCK_KNOB, 16))
    bm = row_block(rows, block_ms, s_rows, s_bm)
    s_splits = int(config.get("num_splits", 1)) or auto_split_count(
        s_batch, s_rows, s_kv, s_bm, int(config.get("block_n", 64)), units)
    if (2 * s_batch * -(-s_rows // s_bm) * s_splits <= units
            and batch * -(-rows // bm) * s_splits <= units):
        return bm, float(s_splits)  # half a wave there, under one here: not for occupancy
    return bm, s_splits * model(batch, rows, kv_len, bm) / model(s_batch, s_rows, s_kv, s_bm)


def split_gap(splits: int, want: float) -> float:
    """How far a candidate's split count is from the model's target, in log2; automatic
    (0) is never near (the model names a count)."""
    return abs(math.log2(splits) - math.log2(want)) if splits > 0 else math.inf


def model_ranking(candidates: list, block_m: int | None, want_splits: float,
                  keep: dict | None = None, choices: dict | None = None,
                  suspect: list | None = None) -> list[int]:
    """Candidate indices, best first, for the row model's (`block_m`, `want_splits`): the
    unsuspected before the suspected (`suspect[i]`), then the wanted block, then the fewest
    knobs differing from `keep` (a tuned config; the row knobs aside), nearest first by
    position in the declared `choices` (e.g. TMA loads with a host descriptor become TMA
    loads, not pointer loads), then the split count nearest the target, then candidate
    order (the space's declared order)."""
    def score(i: int) -> tuple:
        c = candidates[i]
        miss_block = block_m is not None and ROW_BLOCK_KNOB in c \
            and int(c[ROW_BLOCK_KNOB]) != block_m
        miss = far = 0
        for k, v in (keep or {}).items():
            if k in ROW_KNOBS or k not in c or c[k] == v:
                continue
            miss += 1
            order = list((choices or {}).get(k, ()))
            far += abs(order.index(c[k]) - order.index(v)) \
                if v in order and c[k] in order else 1
        return (bool(suspect and suspect[i]), miss_block, miss, far,
                split_gap(int(c.get("num_splits", 1)), want_splits), i)

    return sorted(range(len(candidates)), key=score)


def transfer_distance(batch: int, kv_len: int, rows: int, q_len: int, tuned_batch: int,
                      tuned_kv_len: int, tuned_rows: int, tuned_q_len: int) -> tuple:
    """Sort key of a tuned uniform shape of any q_len/heads family for a call: distance
    over (log batch, log kv length, log rows per sequence), then the q_len gap (causal
    masking and host-made descriptors depend on it), ties to the smaller tuned shape."""
    return (math.sqrt((math.log(tuned_batch) - math.log(batch)) ** 2
                      + (math.log(tuned_kv_len) - math.log(kv_len)) ** 2
                      + (math.log(tuned_rows) - math.log(rows)) ** 2),
            abs(tuned_q_len - q_len), tuned_rows, tuned_batch, tuned_kv_len)


def row_model_picks(batch: int, rows: int, kv_len: int, units: int, candidates: list,
                    tiers: list, choices: dict, source: tuple | None,
                    limit: int) -> tuple[list[int], int | None, float]:
    """The row model's choice among a family's feasible `candidates` for a call (none of
    them stored wrong here; `tiers[i]` their trust tier, 2 = suspect): up to `limit`
    indices, best first, each differing from the one before in a compiled knob; with the
    block (None for a family without one) and the split target the model wanted. `source`
    as `model_knobs` takes it (the tuned variant moved here), None for the heuristic."""
    blocks = {int(c[ROW_BLOCK_KNOB]) for c in candidates if ROW_BLOCK_KNOB in c}
    most = max((int(c.get("num_splits", 1)) for c in candidates), default=1)
    block_m, want = model_knobs(batch, rows, kv_len, units, blocks or {16}, source,
                                max_splits=max(most, 1))
    order = model_ranking(candidates, block_m if blocks else None, want,
                          source[0] if source is not None else None, choices,
                          [t == 2 for t in tiers])
    return distinct_variants(candidates, order, limit), (block_m if blocks else None), want


def row_model_note(rows: int, block_m: int | None, want: float, units: int,
                   unit_name: str) -> str:
    """What the row model wanted, as a route's detail says it."""
    return (f"row model: {rows} rows" + (f" in blocks of {block_m}" if block_m else "")
            + f", {want:.3g} split(s) over {units} {unit_name}")


def transfer_order(batch: int, kv_len: int, rows: int, q_len: int, sources: list) -> list[int]:
    """Indices of tuned uniform shapes to move a variant from, nearest first: `sources[i]`
    is (batch, kv length, rows, q_len, of another q_len/heads family than the call's,
    tie-break text), ordered by `transfer_distance`, the call's own family first on equal
    distance, then the rest of the distance key and the tie-break."""
    keyed = [(transfer_distance(batch, kv_len, rows, q_len, b, kv, r, ql), other, tie, i)
             for i, (b, kv, r, ql, other, tie) in enumerate(sources)]
    keyed.sort(key=lambda x: (x[0][0], x[1], x[0][1:], x[2]))
    return [x[3] for x in keyed]


def library_preferred(batch: int, kv_len: int, rows: int, evidence: list) -> bool:
    """Whether a call without a winner should go to a library that plans its own rows
    rather than to a row-blocked family, from which family won the tuned shapes around it:
    `evidence[i]` is (batch, kv length, rows, won by such a library). A library's lead over
    the row-blocked kernels grows with batch, KV length and rows (on the H200 FlashInfer won
    most bf16 shapes with 64 or more rows at kv 8192 and few small ones), so a library win
    at a shape the call covers in all three (no larger in any) says the library wins here
    too, and a row-blocked win at a shape covering the call says the opposite; other wins
    say nothing. Each weighs exp(-distance) over (log batch, log kv, log rows): one noisy
    neighbour (small shapes, where the library's host-side cost varies 1.3-2x between runs)
    cannot outvote the shapes around it. Ties go to the row-blocked family."""
    votes = [0.0, 0.0]
    for b, kv, r, library in evidence:
        covered = b <= batch and kv <= kv_len and r <= rows
        covering = b >= batch and kv >= kv_len and r >= rows
        if (library and covered) or (not library and covering):
            d = transfer_distance(batch, kv_len, rows, 1, b, kv, r, 1)[0]
            votes[bool(library)] += math.exp(-d)
    return votes[1] > votes[0]


def tuned_route_order(as_tuned: list, moved: list) -> list:
    """Where a call without its own winner goes, in order: a tuned variant of its family
    verified at this very shape (as tuned), the nearest tuned shape's variant moved by the
    row model, then the nearest tuned shape of its family's variant as tuned. `as_tuned`
    holds (trust tier, route) pairs, nearest first; `moved` the moved routes."""
    return ([r for tier, r in as_tuned if tier == 0] + list(moved)
            + [r for tier, r in as_tuned if tier > 0][:1])


def closest_splits(candidate_splits: list, want: int, suspect: list | None = None) -> int:
    """Index of the candidate whose `num_splits` is nearest `want` in log2 (0 = auto is
    never nearest), the first on ties, unsuspected ones (`suspect[i]` false) before any
    suspected: the heuristic's pick among a family's candidates."""
    def gap(i: int) -> tuple[bool, float, int]:
        n = int(candidate_splits[i])
        return (bool(suspect and suspect[i]),
                abs(math.log2(n) - math.log2(want)) if n > 0 else math.inf, i)

    return min(range(len(candidate_splits)), key=gap)


_RANK_OF_REASON = {"exact": 0, "nearest": 1, "transfer": 2}


def format_rank(reason: str | None, tuned_us: float | None, total_kv: int,
                tuned_total_kv: int | None, kv_format: str) -> tuple[int, float, int]:
    """Sort key of a KV format for a call: formats with an exact winner first, then those
    with a nearest tuned shape of the call's family, then those with a tuned shape of
    another q_len/heads family to transfer, each by its tuned median scaled by the ratio
    of KV tokens (decode is memory-bound); formats without tuned data last, in
    `FORMAT_NAMES` order. `reason` is "exact", "nearest", "transfer" or None (no tuned
    shape)."""
    order = FORMAT_NAMES.index(kv_format)
    if reason not in _RANK_OF_REASON or tuned_us is None or not tuned_total_kv:
        return (len(_RANK_OF_REASON), math.inf, order)
    return (_RANK_OF_REASON[reason], tuned_us * total_kv / tuned_total_kv, order)


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
