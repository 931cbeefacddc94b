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
    assert host_block_ns(Shape(batch=2, kv_lens=(1024, 96))) == {32}
    assert host_block_ns(Shape(batch=2, kv_lens=(1024, 100))) == set()
    assert host_block_ns(Shape.uniform(4, 1024, q_len=2)) == set()


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
