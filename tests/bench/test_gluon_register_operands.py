"""bench/gluon_register_operands.py: MXFP4 bytes decoded into warpgroup-MMA register
operands stay in the registers of the thread that feeds them (no shuffles, no shared memory
besides the B operand, vector byte loads), for both products' layouts."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

import gluon_register_operands as gro  # noqa: E402

B_OPERAND = 64 * 16 * 2
"""Bytes of the probes' one shared buffer: the MMAs' B operand (64 x 16 bf16)."""


@pytest.mark.parametrize("kernel, loads, mmas", [
    ("scores_operand", 2, 4),    # a key row's 8 bytes for rows m and m + 8; 4 k-steps
    ("values_operand", 16, 32),  # one 8-byte load per key; 8 chunks x 4 k-steps
])
def test_decoded_operands_never_leave_their_thread(kernel: str, loads: int, mmas: int) -> None:
    r = gro.report(getattr(gro, kernel))
    assert r["shfl.sync"] == 0 and r["ld.shared"] == 0
    assert r["shared"] == B_OPERAND
    assert r["ld.global.v2"] == loads and r["ld.global.u8"] == r["ld.global.b8"] == 0
    assert r["wgmma.mma_async"] == mmas
