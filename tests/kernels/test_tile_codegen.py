"""What the KV-tile loop compiles to on sm_90 (cross-compiled, no GPU): properties the H200
speed of the suites rests on, each measured when it landed
(bench/results/h200_triton_qk_mxfp4_2026-11-30.md), so a kernel edit that loses one fails
here instead of in the next sweep."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import kernel_ptx_stats as kps  # noqa: E402


def _stats(text: str) -> dict[str, int]:
    return kps.stats(kps.compile_split(kps.parse_variant(text)[3], "cuda:90", heads=16))


def test_mxfp4_tile_is_decoded_into_shared_memory_with_16_byte_stores() -> None:
    # 64 keys x 576 dims of bf16 over 128 threads: 576 B per thread, 36 16-byte stores.
    # With the packed bytes loaded per 32-dim block the decoded values reached shared
    # memory one bf16 at a time (288 st.shared.b16 per thread and tile).
    s = _stats("mxfp4:1x1:block_n=64,num_stages=2")
    assert s["st.shared.b16"] == 0, s
    assert s["st.shared.v4"] == 36, s
    assert s["spill_bytes"] == 0
