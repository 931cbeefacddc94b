"""The row model of mla_tune/runtime/routing_rules.py on synthetic winner tables: which row block a
call gets (rows covered), which split count (row blocks counted over the SMs), what a tuned
variant keeps when it moves to another q_len/heads family, and the order of fallbacks.
The candidates are the Triton family's real feasible grid for the H200 space (shape
arithmetic only: nothing is compiled or run)."""

from __future__ import annotations

import math

import pytest
import torch

from mla_tune.backends.triton_family import TritonFamily
from mla_tune.problem.shapes import Shape
from mla_tune.runtime.routing_rules import (
    auto_split_count,
    distinct_variants,
    format_rank,
    library_preferred,
    model_knobs,
    model_ranking,
    occupancy_splits,
    row_block,
    split_gap,
    transfer_distance,
)
from mla_tune.tuning.space import load_backend_space

H200_SMS = 132
CUDA = torch.device("cuda")  # the declared space of CUDA devices; no GPU is touched
FAMILY = TritonFamily()
CHOICES = dict(load_backend_space("triton", "cuda").params)

# A tuned q_len 1, 16-head bf16 winner as the H200 sweep stores them.
Q1H16 = {"block_m": 16, "block_n": 32, "compute": "bf16", "fast_mode": True,
         "fp8_convert": "staged", "kv_load": "tma_host", "num_splits": 8, "num_stages": 3,
         "num_warps": 4, "page_size": 1}


def candidates(shape: Shape) -> list[dict]:
    return FAMILY.candidates(shape, CUDA)


def test_the_row_block_is_the_largest_the_rows_fill() -> None:
    blocks = {16, 32}
    assert [row_block(r, blocks) for r in (8, 16, 24, 32, 64, 128, 512)] == \
        [16, 16, 16, 32, 32, 32, 32]
    assert row_block(128, {16, 32, 64}) == 64
    # A tuned source keeps its block at its own rows, and a smaller block it measured
    # faster where it could have taken the larger one caps the pick elsewhere.
    assert row_block(24, blocks, source_rows=24, source_block_m=32) == 32
    assert row_block(128, blocks, source_rows=64, source_block_m=16) == 16
    assert row_block(128, blocks, source_rows=16, source_block_m=16) == 32
    assert row_block(16, blocks, source_rows=128, source_block_m=32) == 16


@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_the_heuristic_covers_the_rows_in_as_few_blocks_as_the_space_allows(
        q_len: int, heads: int, fmt: str) -> None:
    shape = Shape.uniform(32, 8192, q_len=q_len, heads=heads, kv_format=fmt)
    cands = candidates(shape)
    rows = q_len * heads
    block_m, want = model_knobs(shape.batch, rows, shape.kv_len, H200_SMS,
                                {c["block_m"] for c in cands})
    best = cands[model_ranking(cands, block_m, want)[0]]
    assert best["block_m"] == (16 if rows < 32 else 32)
    assert best["num_warps"] == (4 if rows < 32 else 8)
    assert FAMILY.feasible(shape, best)
    # Splits come from the occupancy model over the row blocks actually launched.
    blocks = math.ceil(rows / best["block_m"])
    assert want == occupancy_splits(shape.batch, rows, shape.kv_len, H200_SMS,
                                    rows_per_block=best["block_m"])
    nearest = min({c["num_splits"] for c in cands if c["num_splits"]},
                  key=lambda n: abs(math.log2(n) - math.log2(want)))
    assert best["num_splits"] == nearest
    assert shape.batch * blocks * best["num_splits"] >= H200_SMS // 2 or want == 1


def test_the_occupancy_model_counts_row_blocks() -> None:
    # 4 sequences of 128 rows: 8 row blocks of 16 or 4 of 32 per sequence, so fewer
    # splits fill the H200 with the smaller blocks.
    fine = occupancy_splits(4, 128, 8192, H200_SMS, rows_per_block=16)
    coarse = occupancy_splits(4, 128, 8192, H200_SMS, rows_per_block=32)
    assert fine < coarse
    assert 4 * 8 * fine <= 2 * H200_SMS and 4 * 4 * coarse <= 2 * H200_SMS
    # One wave of single-split programs for a large batch; none below 32 keys a split.
    assert occupancy_splits(128, 16, 8192, H200_SMS) == 1
    assert occupancy_splits(2, 16, 64, H200_SMS) <= 2


def test_a_tuned_split_count_calibrates_the_model() -> None:
    source = (Q1H16, 32, 16, 8192)  # tuned 8 splits where the model says 4
    model_there = occupancy_splits(32, 16, 8192, H200_SMS)
    assert model_there == 4
    for batch, rows, kv in ((4, 128, 8192), (128, 64, 1024), (32, 16, 8192)):
        block_m, want = model_knobs(batch, rows, kv, H200_SMS, {16, 32}, source)
        here = occupancy_splits(batch, rows, kv, H200_SMS, rows_per_block=block_m)
        assert want == pytest.approx(8 * here / model_there)
    # Automatic splits count as what the kernel made of them at the tuned shape.
    auto = dict(Q1H16, num_splits=0, block_n=64)
    resolved = auto_split_count(32, 16, 8192, 16, 64, H200_SMS)
    block_m, want = model_knobs(4, 128, 8192, H200_SMS, {16, 32}, (auto, 32, 16, 8192))
    here = occupancy_splits(4, 128, 8192, H200_SMS, rows_per_block=block_m)
    assert want == pytest.approx(resolved * here / model_there)
    assert split_gap(0, 4.0) == math.inf and split_gap(4, 4.0) == 0


def test_a_split_count_under_one_wave_is_kept_while_the_call_stays_under_one() -> None:
    """16 splits won at 4x8192 (64 programs) and at 8x8192 (128); the model's trend from 4
    to 8 sequences halves its count, which cost 1.6x at 8x8192 bf16 on the H200."""
    source = (dict(Q1H16, num_splits=16), 4, 16, 8192)
    trend = 16 * occupancy_splits(8, 16, 8192, H200_SMS) / occupancy_splits(
        4, 16, 8192, H200_SMS, max_splits=32)
    assert trend == 8
    assert model_knobs(8, 16, 8192, H200_SMS, {16}, source, max_splits=32) == (16, 16.0)
    assert model_knobs(2, 16, 8192, H200_SMS, {16}, source, max_splits=32) == (16, 16.0)
    # A count that filled a wave where it was tuned was an occupancy choice: the trend.
    full = (dict(Q1H16, num_splits=2), 64, 16, 1024)
    _, want = model_knobs(32, 16, 1024, H200_SMS, {16}, full, max_splits=32)
    assert want == pytest.approx(2 * occupancy_splits(32, 16, 1024, H200_SMS, max_splits=32)
                                 / occupancy_splits(64, 16, 1024, H200_SMS, max_splits=32))
    assert want > 2
    # 16 sequences at 16 splits are two waves: occupancy decides again.
    _, want = model_knobs(16, 16, 8192, H200_SMS, {16}, source, max_splits=32)
    assert want == pytest.approx(16 * occupancy_splits(16, 16, 8192, H200_SMS, max_splits=32)
                                 / occupancy_splits(4, 16, 8192, H200_SMS, max_splits=32))


def test_automatic_splits_are_two_waves_within_one_split_per_tile() -> None:
    assert auto_split_count(32, 16, 8192, 16, 64, H200_SMS) == 9  # 32 programs: 264 / 32
    assert auto_split_count(4, 128, 8192, 32, 64, H200_SMS) == 17  # 16 programs
    assert auto_split_count(2, 16, 256, 16, 64, H200_SMS) == 4  # 4 tiles of 64 keys
    assert auto_split_count(1, 16, 1 << 20, 16, 64, H200_SMS) == 64
    assert auto_split_count(512, 64, 8192, 32, 64, H200_SMS) == 1


def test_a_transferred_variant_keeps_its_knobs_where_the_call_allows() -> None:
    # q_len 4 x 32 heads: 128 rows, blocks of 32 on 8 warps need 64-key tiles, and host
    # descriptors need q_len 1, so TMA loads stay TMA loads; the rest is kept.
    shape = Shape.uniform(32, 8192, q_len=4, heads=32)
    cands = candidates(shape)
    block_m, want = model_knobs(32, 128, 8192, H200_SMS, {16, 32}, (Q1H16, 32, 16, 8192))
    order = model_ranking(cands, block_m, want, Q1H16, CHOICES)
    best = cands[order[0]]
    assert (best["block_m"], best["num_warps"], best["block_n"]) == (32, 8, 64)
    assert best["kv_load"] == "tma"
    assert {k: best[k] for k in ("compute", "fast_mode", "num_stages", "fp8_convert")} == \
        {"compute": "bf16", "fast_mode": True, "num_stages": 3, "fp8_convert": "staged"}
    assert best["num_splits"] == min(
        {c["num_splits"] for c in cands if c["num_splits"]},
        key=lambda n: abs(math.log2(n) - math.log2(want)))
    # The alternatives differ in a compiled knob, so a precheck that prunes the first
    # (e.g. shared memory of 3 stages of 64-key tiles) does not prune them all.
    picked = distinct_variants(cands, order, 3)
    assert picked[0] == order[0] and len(picked) == 3
    strip = [{k: v for k, v in cands[i].items() if k not in ("num_splits", "fast_mode")}
             for i in picked]
    assert len({tuple(sorted(s.items())) for s in strip}) == 3
    # A suspected candidate goes last even if it matches best.
    suspect = [i == order[0] for i in range(len(cands))]
    assert model_ranking(cands, block_m, want, Q1H16, CHOICES, suspect)[0] != order[0]


def test_fp8_at_32_rows_takes_a_path_that_keeps_its_tile_in_registers() -> None:
    shape = Shape.uniform(32, 8192, q_len=2, heads=16, kv_format="fp8")
    cands = candidates(shape)
    wide = [c for c in cands if c["block_m"] == 32]
    assert wide and {c["compute"] for c in wide} == {"fp8", "fp8qk"}
    assert {c["block_n"] for c in wide} == {64}
    assert not any(c["block_m"] == 32 for c in candidates(Shape.uniform(32, 8192)))


def test_the_nearest_family_shares_the_rows_then_the_q_len() -> None:
    call = (32, 8192, 128, 4)  # batch, kv, rows, q_len of a q_len 4 x 32-head call
    tuned = {  # same batch and kv in each family
        "q1 h16": (32, 8192, 16, 1), "q1 h128": (32, 8192, 128, 1),
        "q2 h64": (32, 8192, 128, 2), "q4 h16": (32, 8192, 64, 4),
    }
    ranked = sorted(tuned, key=lambda k: transfer_distance(*call, *tuned[k]))
    assert ranked[:2] == ["q2 h64", "q1 h128"]
    assert ranked[-1] == "q1 h16"
    # Batch and kv length count as before: a closer shape of a farther family can win.
    assert transfer_distance(*call, 32, 8192, 64, 4) < transfer_distance(*call, 4, 1024,
                                                                         128, 2)


def test_only_wins_that_bound_the_call_vote_and_near_ones_weigh_more() -> None:
    call = (32, 1024, 64)
    # A library win at a shape the call covers says the library wins here ...
    assert library_preferred(*call, [(32, 1024, 32, True)])
    # ... one at a larger shape says nothing (its lead grows with the work).
    assert not library_preferred(*call, [(32, 8192, 64, True)])
    # A row-blocked win at a covering shape outweighs a farther library win below.
    assert not library_preferred(*call, [(4, 1024, 64, True), (32, 1024, 128, False)])
    assert library_preferred(*call, [(32, 1024, 64, True), (32, 8192, 128, False)])
    # A row-blocked win below the call says nothing; ties go to the row-blocked family.
    assert not library_preferred(*call, [(4, 1024, 16, False)])
    assert not library_preferred(*call, [(32, 1024, 64, True), (32, 1024, 64, False)])


def test_formats_rank_exact_then_nearest_then_transfer_then_untuned() -> None:
    ranks = [format_rank(r, 10.0, 100, 100, "bf16") for r in ("exact", "nearest",
                                                                "transfer", None)]
    assert ranks == sorted(ranks) and len(set(r[0] for r in ranks)) == 4
    # Within one tier the tuned time, scaled by the KV tokens, decides.
    assert format_rank("transfer", 10.0, 200, 100, "fp8") > \
        format_rank("transfer", 15.0, 100, 100, "mxfp4")
