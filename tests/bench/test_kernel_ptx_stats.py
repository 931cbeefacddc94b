"""bench/kernel_ptx_stats.py reads the KV-tile loop out of the sm_90 PTX of a variant: the
counts kernel work relies on (which MMA each product lowers to) come out of it."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import kernel_ptx_stats as kps  # noqa: E402

import benchkit  # noqa: E402


def _stats(text: str) -> dict[str, int]:
    return kps.stats(kps.compile_split(benchkit.parse_variant(text)[1], "cuda:90", heads=16))


def test_bf16_at_32_keys_uses_mma_sync_for_qk_and_wgmma_for_pv() -> None:
    s = _stats("bf16:4x1024:block_n=32,num_stages=2")
    assert s["regs"] > 0 and s["smem"] > 0
    assert s["mma.sync"] > 0 and s["wgmma.mma_async"] > 0 and s["cp.async.cg"] > 0


def test_fp8qk_at_64_keys_is_all_wgmma() -> None:
    s = _stats("fp8:4x1024:compute=fp8qk,block_n=64,num_stages=3,fp8_convert=operand")
    assert s["mma.sync"] == 0 and s["wgmma.mma_async"] > 0 and s["spill_bytes"] == 0


def test_tile_loop_is_empty_without_a_loop() -> None:
    assert kps.tile_loop("ld.global.b32 %r1, [%rd1];\nret;") == ""


def test_a_page_index_per_tile_leaves_one_table_load_in_the_sass_tile_loop() -> None:
    from mla_tune.kernels.triton import mla_decode as md

    loops = {}
    for rows in ("key", "tile"):
        cfg = benchkit.parse_variant(f"bf16:4x1024:block_n=32,num_stages=3,page_size=64,"
                                     f"page_rows={rows}")[1]
        kernel = kps.compile_split(cfg, "cuda:90", 16, md.SCHED_PAGED)
        loops[rows] = kps.sass_tile_loop(kernel.asm["cubin"], kps.nvdisasm_path())
    # 32 keys x 576 bf16 per tile: 18 16-byte cp.async per thread either way; the table
    # entries of the rows a thread copies (18) against one index per tile.
    assert loops["key"]["LDGSTS"] == loops["tile"]["LDGSTS"] == 18
    assert loops["key"]["LDG"] == 18 and loops["tile"]["LDG"] == 1
    assert sum(loops["tile"].values()) < sum(loops["key"].values())
