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
