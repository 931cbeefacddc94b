"""What the KV-tile loop compiles to on sm_90 (cross-compiled, no GPU): properties the H200
speed of the suites rests on, each measured when it landed
(docs/design/triton_kernel.md), so a kernel edit that loses one fails
here instead of in the next sweep."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import kernel_ptx_stats as kps  # noqa: E402

import benchkit  # noqa: E402


@functools.cache
def _compiled(text: str) -> Any:
    """Variant `text` compiled for sm_90 (once per test session: two tests read the fp8 one)."""
    return kps.compile_split(benchkit.parse_variant(text)[1], "cuda:90", heads=16)


def _stats(text: str) -> dict[str, int]:
    return kps.stats(_compiled(text))


@pytest.mark.parametrize("variant", ["bf16:1x1:block_n=32,num_stages=3,kv_load=tma",
                                     "fp8:1x1:block_n=32,num_stages=2,compute=fp16,"
                                     "fp8_convert=operand"])
def test_qk_at_32_keys_is_not_computed_twice(variant: str) -> None:
    # QK^T of a 32-key tile over 576 dims is 36 16-dim steps; with keys as the M side the
    # four warps split 32 rows two ways and each pair computed the same half (72 MMAs per
    # warp). Query rows as M give each warp its own 8 keys: 36 m16n8k16 MMAs per warp.
    s = _stats(variant)
    assert s["mma.sync"] == 36, s
    assert s["spill_bytes"] == 0


def test_mxfp4_tile_is_decoded_into_shared_memory_with_16_byte_stores() -> None:
    # 64 keys x 576 dims of bf16 over 128 threads: 576 B per thread, 36 16-byte stores.
    # With the packed bytes loaded per 32-dim block the decoded values reached shared
    # memory one bf16 at a time (288 st.shared.b16 per thread and tile).
    s = _stats("mxfp4:1x1:block_n=64,num_stages=2")
    assert s["st.shared.b16"] == 0, s
    assert s["st.shared.v4"] == 36, s
    assert s["spill_bytes"] == 0


def test_fp8_values_reach_the_e4m3_mma_in_16_byte_reads() -> None:
    # The e4m3 P V contracts over keys, across the stored rows. With the value dims in
    # _dims_interleaved order each thread's 16 A-operand rows are 16 consecutive bytes of a
    # row: 64 keys x 512 dims over 128 threads is 16 16-byte reads per tile, transposed in
    # registers. In natural order the tile went back to shared memory one byte at a time
    # (264 st.shared.b8 per thread and tile; 256x8192 on the H200: 312 vs 421 us for the
    # fp8qk path before it).
    s = _stats("fp8:1x1:compute=fp8,block_n=64,num_stages=3,kv_load=tma")
    assert s["st.shared.b8"] <= 8, s  # P's 64 x 16 bytes: 8 per thread
    assert s["ld.shared.b8"] == 0, s
    assert s["ld.shared.v4"] == 16, s
    assert s["wgmma.mma_async"] == 34, s  # 18 for QK^T, 16 for P V, all e4m3
    assert s["spill_bytes"] == 0


def test_fp8_output_is_stored_in_whole_rows() -> None:
    # The accumulator's rows are the interleaved dims; they go back to natural order once
    # per program (through shared memory) so the output and partials are stored with
    # 16-byte stores. Stored at the interleaved dims (one bf16 or float32 per store) the
    # epilogue took 8 us of a 256x8192 program on the H200 (bf16's: 0.5).
    ptx = _compiled("fp8:1x1:compute=fp8,block_n=64,num_stages=3,kv_load=tma").asm["ptx"]
    assert ptx.count("st.global.b16") == 0
    assert ptx.count("st.global.b32") <= 2  # the partial's log-sum-exp
    assert ptx.count("st.global.v4.b32") >= 16
