"""The Triton family's space: knobs that do not apply to a shape add no duplicate points."""

import torch

from mla_tune.backends.triton_family import TritonFamily
from mla_tune.problem.shapes import KVFormat, Shape


def _converts(fmt: KVFormat) -> set[tuple[str, str]]:
    shape = Shape.uniform(4, 1024, kv_format=fmt)
    return {(c["compute"], c["fp8_convert"])
            for c in TritonFamily().candidates(shape, torch.device("cuda"))}


def test_fp8_conversion_mode_is_a_knob_only_for_fp8_on_16_bit_mmas():
    # fp8qk converts the values (P V on fp16), so it has both modes; fp8 converts nothing.
    assert _converts(KVFormat.FP8) == {("bf16", "staged"), ("bf16", "operand"),
                                       ("fp16", "staged"), ("fp16", "operand"),
                                       ("fp8qk", "staged"), ("fp8qk", "operand"),
                                       ("fp8", "staged")}
    assert _converts(KVFormat.BF16) == {("bf16", "staged")}
    assert _converts(KVFormat.MXFP4) == {("bf16", "staged")}


def _loads(shape: Shape) -> set[str]:
    return {c["kv_load"] for c in TritonFamily().candidates(shape, torch.device("cuda"))}


def test_tma_loads_are_a_knob_only_for_contiguous_bf16_and_unconverted_fp8_kv():
    assert _loads(Shape.uniform(4, 1024)) == {"pointer", "tma", "tma_host"}
    fp8 = Shape.uniform(4, 1024, kv_format=KVFormat.FP8)
    by_compute = {(c["compute"], c["kv_load"])
                  for c in TritonFamily().candidates(fp8, torch.device("cuda"))}
    assert {load for compute, load in by_compute if compute == "fp8"} == {
        "pointer", "tma", "tma_host"}
    assert {load for compute, load in by_compute if compute != "fp8"} == {"pointer"}
    assert _loads(Shape.uniform(4, 1024, kv_format=KVFormat.MXFP4)) == {"pointer"}
    assert _loads(Shape.uniform(4, 1024, page_size=16)) == {"pointer"}
    assert _loads(Shape.uniform(4, 1024, kv_format=KVFormat.FP8, page_size=16)) == {"pointer"}


def test_host_made_descriptors_only_where_no_tile_reaches_past_its_keys():
    # One pair of descriptors for the whole cache: a partial last tile, or a causal end
    # inside the sequence (q_len > 1), would read the next keys instead of zeros.
    def host_block_ns(shape: Shape) -> set[int]:
        return {c["block_n"] for c in TritonFamily().candidates(shape, torch.device("cuda"))
                if c["kv_load"] == "tma_host"}

    assert host_block_ns(Shape.uniform(4, 1024)) == {32, 64}
    assert host_block_ns(Shape.uniform(4, 96)) == {32}
    assert host_block_ns(Shape.uniform(4, 100)) == set()
    assert host_block_ns(Shape.uniform(4, 1024, q_len=2)) == set()
    # Ragged shapes run the balanced schedule, whose programs make their own descriptors
    # ('tma_host' would run as 'tma': the same point twice), whole tiles or not.
    assert host_block_ns(Shape(batch=2, kv_lens=(1024, 96))) == set()


def test_plain_merge_launch_is_a_knob_only_where_a_second_launch_runs():
    from mla_tune.backends.triton_family import kernel_config

    shape = Shape.uniform(4, 1024)
    points = TritonFamily().candidates(shape, torch.device("cuda"))
    plain = [c for c in points if not c["pdl"]]
    assert plain and all(not c["fast_mode"] and c["num_splits"] != 1 for c in plain)
    assert any(c["pdl"] and c["fast_mode"] for c in points)
    cfg = kernel_config(shape, plain[0])
    assert cfg.pdl is False
    # The merge kernel of a plain point is an ordinary launch on sm_90; PDL's otherwise.
    assert "launch_pdl" not in cfg.merge_options(upcast=False, nvidia=True)
    pdl_cfg = kernel_config(shape, {**plain[0], "pdl": True})
    assert pdl_cfg.merge_options(upcast=False, nvidia=True)["launch_pdl"] is True
    # Stored configs from before the knob (no "pdl" key) keep the PDL merge.
    old = {k: v for k, v in plain[0].items() if k != "pdl"}
    assert kernel_config(shape, old).pdl is True



def test_seg_cost_is_a_knob_only_of_the_balanced_schedule():
    # Uniform shapes run per-sequence splits, which charge no setup per sequence: one
    # point per variant. Ragged shapes (the balanced schedule) take every charge.
    from mla_tune.kernels.triton.launch import variant_feasible

    fam, cuda = TritonFamily(), torch.device("cuda")
    uniform, ragged = Shape.uniform(4, 1024), Shape(batch=3, kv_lens=(1000, 300, 517))
    assert {c["seg_cost"] for c in fam.candidates(uniform, cuda)} == {1}
    assert {c["seg_cost"] for c in fam.candidates(ragged, cuda)} == {1, 2, 4, 8}
    point = {**fam.candidates(uniform, cuda)[0], "seg_cost": 4}
    assert not fam.feasible(uniform, point) and fam.feasible(ragged, point)
    # A length bucket's runner is balanced whatever lengths it is checked at.
    assert variant_feasible("bf16", uniform.kv_lens, 1, 16, 1, point, balanced=True)
    # The balanced contiguous runner reads direct rows: no page-size knob either.
    assert all(c["page_size"] == 1 for c in fam.candidates(ragged, cuda))


def test_tma_reads_a_page_pool_only_in_the_balanced_runner_with_pages_of_a_tile():
    # The balanced runner takes TMA tiles from pages of at least a tile
    # (mla_decode.pool_tma); per-sequence splits over a page table and pages shorter than
    # a tile keep pointer loads.
    fam, cuda = TritonFamily(), torch.device("cuda")
    for page, block_n, tma in ((64, 64, True), (32, 64, False), (64, 32, True), (32, 32, True),
                               (16, 32, False)):
        ragged = Shape(batch=3, kv_lens=(1000, 300, 517), page_size=page, kv_format="fp8")
        loads = {c["kv_load"] for c in fam.candidates(ragged, cuda)
                 if c["block_n"] == block_n and c["compute"] == "fp8"}
        assert ("tma" in loads) == tma and "tma_host" not in loads and "pointer" in loads
    uniform = Shape.uniform(4, 1024, page_size=64, kv_format="fp8")
    assert {c["kv_load"] for c in fam.candidates(uniform, cuda)} == {"pointer"}
    # bf16 tiles of 64 keys keep pointer loads from a pool (wrong at partial tiles on the
    # H200 through TMA); 32-key tiles take TMA.
    ragged = Shape(batch=3, kv_lens=(1000, 300, 517), page_size=64, kv_format="bf16")
    loads = {(c["block_n"], c["kv_load"]) for c in fam.candidates(ragged, cuda)}
    assert {kv_load for block_n, kv_load in loads if block_n == 64} == {"pointer"}
    assert (32, "tma") in loads


def test_a_page_index_per_tile_only_for_pointer_loads_from_pages_of_a_tile():
    # page_rows='tile' (mla_decode.paged_tiles) exists where a tile lies in one page of a
    # pool the balanced runner reads with pointer loads; elsewhere a point keeps 'key'.
    from mla_tune.backends.triton_family import kernel_config

    fam, cuda = TritonFamily(), torch.device("cuda")
    for fmt, page, block_n, tile in (("fp8", 64, 64, True), ("fp8", 32, 64, False),
                                     ("bf16", 64, 32, True), ("bf16", 16, 32, False),
                                     ("mxfp4", 32, 32, True), ("bf16", 1, 32, False)):
        ragged = Shape(batch=3, kv_lens=(1000, 300, 517), page_size=page, kv_format=fmt)
        rows = {(c["kv_load"], c["page_rows"]) for c in fam.candidates(ragged, cuda)
                if c["block_n"] == block_n}
        assert ("pointer", "tile") in rows if tile else {r for _, r in rows} == {"key"}
        assert not {load for load, r in rows if r == "tile"} - {"pointer"}
    for shape in (Shape.uniform(4, 1024, page_size=64), Shape.uniform(4, 1024)):
        assert {c["page_rows"] for c in fam.candidates(shape, cuda)} == {"key"}
    ragged = Shape(batch=3, kv_lens=(1000, 300, 517), page_size=64, kv_format="fp8")
    point = next(c for c in fam.candidates(ragged, cuda) if c["page_rows"] == "tile")
    assert kernel_config(ragged, point).page_rows == "tile"


def test_chunked_runs_only_for_balanced_runners_and_without_a_setup_charge():
    # bucket_runs='chunks' (no run crosses a sequence) exists for ragged shapes, whose
    # builds are the length buckets' runners, with seg_cost at its default (unused there).
    from mla_tune.backends.triton_family import kernel_config

    fam, cuda = TritonFamily(), torch.device("cuda")
    for page in (1, 64):
        ragged = Shape(batch=3, kv_lens=(1000, 300, 517), page_size=page, kv_format="fp8")
        runs = {(c["bucket_runs"], c["seg_cost"]) for c in fam.candidates(ragged, cuda)}
        assert {r for r, _ in runs} == {"stream", "chunks"}
        assert {s for r, s in runs if r == "chunks"} == {1}
        assert {s for r, s in runs if r == "stream"} == {1, 2, 4, 8}
        point = next(c for c in fam.candidates(ragged, cuda) if c["bucket_runs"] == "chunks")
        assert kernel_config(ragged, point).bucket_runs == "chunks"
    for shape in (Shape.uniform(4, 1024, page_size=64), Shape.uniform(4, 1024)):
        assert {c["bucket_runs"] for c in fam.candidates(shape, cuda)} == {"stream"}


def test_configs_stored_before_a_knob_validate_to_its_default():
    from mla_tune.backends.triton_family import kernel_config
    from mla_tune.kernels.triton.launch import variant_seg_cost
    from mla_tune.kernels.triton.mla_decode import SEG_COST
    from mla_tune.kernels.triton.static_check import compiled_key

    fam = TritonFamily()
    for device in (torch.device("cuda"), torch.device("cpu")):
        space = fam.declared_space(device).restrict({"num_splits": 1})  # pins keep them
        point = next(space.grid())
        old = {k: v for k, v in point.items()
               if k not in ("seg_cost", "pdl", "page_rows", "bucket_runs")}
        assert space.validate(old) == space.validate(point) == point
        assert variant_seg_cost(old) == SEG_COST == point["seg_cost"]
    # seg_cost is a runtime argument: every value is the same compiled kernel.
    shape = Shape(batch=2, kv_lens=(1024, 96))
    keys = {compiled_key(kernel_config(shape, {**point, "seg_cost": s})) for s in (1, 2, 4, 8)}
    assert len(keys) == 1
