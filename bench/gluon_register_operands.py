"""Can MXFP4 bytes be decoded straight into warpgroup-MMA register operands? A design probe
for the MXFP4 kernel's shared-memory bound (bench/results/gluon_family.md): two small Gluon
kernels cross-compiled for sm_90a without a GPU, and what their PTX holds.

- `scores_operand`: S^T = K Q^T for one 64-key x 64-dim chunk, K (keys on M) the A operand
  in registers. A thread's bytes are eight consecutive ones of a key row (one vector load):
  the chunk's dims are relabelled so that MMA k = 8 r + 2 t + p is dim 2 (r + 8 t) + p
  (r: register, t: lane in the quad, p: nibble); Q takes the same order once per program.
- `values_operand`: O^T = V^T P^T for all 512 value dims in 8 chunks of 64, V^T (dims on M)
  the A operand in registers. The nibble pair of a byte lands on rows m and m + 8 (one
  thread), and the 8 chunks' bytes of a key are adjacent (one vector load per key); the
  output's dims are put back when stored.

Both decode with the Gluon family's E2M1 routine (scale 1). The point is the data flow:
no shuffles and no shared memory besides the MMAs' B operand mean the decoded values never
leave the registers of the thread that feeds them to the tensor cores. Values are not
checked here (Gluon has no interpreter): a GPU kernel built on this must be.

    python3 bench/gluon_register_operands.py
"""

from __future__ import annotations

import re
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from triton.runtime.jit import constexpr_function

from mla_tune.kernels.gluon.mla_decode import E2M1_PTX
from mla_tune.kernels.triton.precompile import jit_compile

ROW = gl.constexpr(288)
"""Bytes of one MXFP4 key row (576 dims)."""


@constexpr_function
def _acc_layout():
    """A 64 x 16 accumulator of one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, 16, 16])


@constexpr_function
def _a_layout():
    """The register A operand of that MMA (bf16: k pairs per register)."""
    return gl.DotOperandLayout(operand_index=0, parent=_acc_layout(), k_width=2)


@gluon.jit
def _e2m1(raw):
    """Packed bytes -> (low nibbles, high nibbles) as bf16, scale 2^0."""
    one = gl.full(raw.shape, 127 << 7, gl.int16, layout=raw.type.layout).to(
        gl.bfloat16, bitcast=True)
    return gl.inline_asm_elementwise(E2M1_PTX, "=r,=r,=r,=r,r,r,r", [raw, one],
                                     dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)


@gluon.jit
def _b_operand(X, ROWS_B: gl.constexpr):
    """[ROWS_B, 16] bf16 from global into an MMA B operand buffer."""
    bl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    r = gl.arange(0, ROWS_B, layout=gl.SliceLayout(1, bl))
    n = gl.arange(0, 16, layout=gl.SliceLayout(0, bl))
    x = gl.load(X + r[:, None] * 16 + n[None, :])
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_B, 16], gl.bfloat16)
    buf = gl.allocate_shared_memory(gl.bfloat16, [ROWS_B, 16], sl, x)
    fence_async_shared()
    return buf


@gluon.jit
def scores_operand(RAW, Q, OUT):
    mma: gl.constexpr = _acc_layout()
    # [key 64, r 8, t 4] bytes: byte 8 t + r of the key row.
    raw_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [8, 0, 0]],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 8, 4])
    key = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, raw_l)))
    r = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, raw_l)))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, raw_l)))
    raw = gl.load(RAW + key[:, None, None] * ROW + t[None, None, :] * 8 + r[None, :, None])
    lo, hi = _e2m1(raw)
    a = gl.convert_layout(gl.join(lo, hi).reshape([64, 64]), _a_layout())  # k = 8r + 2t + p
    acc = gl.zeros([64, 16], gl.float32, layout=mma)
    acc = warpgroup_mma(a, _b_operand(Q, 64), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    m = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    n = gl.arange(0, 16, layout=gl.SliceLayout(0, mma))
    gl.store(OUT + m[:, None] * 16 + n[None, :], acc)


@gluon.jit
def _values_chunk(a, p_buf, OUT, chunk: gl.constexpr):
    mma: gl.constexpr = _acc_layout()
    acc = gl.zeros([64, 16], gl.float32, layout=mma)
    acc = warpgroup_mma(gl.convert_layout(a, _a_layout()), p_buf, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    m = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    n = gl.arange(0, 16, layout=gl.SliceLayout(0, mma))
    gl.store(OUT + (chunk * 64 + m[:, None]) * 16 + n[None, :], acc)


@gluon.jit
def values_operand(RAW, P, OUT):
    # [chunk 8, c 32, key 64] bytes: byte 8 c + chunk of the key row; c = g + 8 w.
    raw_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0], [0, 0, 1], [0, 0, 8], [0, 0, 16],
                   [0, 0, 32]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 8, 0], [0, 16, 0]], block_bases=[], shape=[8, 32, 64])
    h = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, raw_l)))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, raw_l)))
    key = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, raw_l)))
    raw = gl.load(RAW + key[None, None, :] * ROW + c[None, :, None] * 8 + h[:, None, None])
    lo, hi = _e2m1(raw)
    # [chunk, w 4, g 8, key, p] -> [chunk, w, p, g, key]: row m = 16 w + 8 p + g.
    x = gl.join(lo, hi).reshape([8, 4, 8, 64, 2]).permute((0, 1, 4, 2, 3)).reshape([8, 64, 64])
    p_buf = _b_operand(P, 64)
    x4a, x4b = x.reshape([2, 4, 64, 64]).permute((1, 2, 3, 0)).split()
    for half in gl.static_range(2):
        x4 = x4a if half == 0 else x4b
        x2a, x2b = x4.reshape([2, 2, 64, 64]).permute((1, 2, 3, 0)).split()
        for quarter in gl.static_range(2):
            x2 = x2a if quarter == 0 else x2b
            x1a, x1b = x2.permute((1, 2, 0)).split()
            _values_chunk(x1a, p_buf, OUT, half * 4 + quarter * 2)
            _values_chunk(x1b, p_buf, OUT, half * 4 + quarter * 2 + 1)


COUNTED = ("shfl.sync", "ld.shared", "st.shared", "ld.global.v2", "ld.global.u8",
           "ld.global.b8", "prmt", "lop3", "mul.rn.bf16x2", "wgmma.mma_async")


def report(kernel: Any) -> dict[str, int]:
    """Shared bytes and PTX instruction counts of one probe kernel, compiled for sm_90a."""
    k = jit_compile(kernel, "cuda:90", (torch.uint8, torch.bfloat16, torch.float32),
                    {"num_warps": 4})
    ptx = k.asm["ptx"]
    out = {"shared": int(k.metadata.shared)}
    for name in COUNTED:
        out[name] = len(re.findall(re.escape(name) + r"[.\s]", ptx))
    return out


def main() -> None:
    for kernel in (scores_operand, values_operand):
        print(kernel.__name__, report(kernel))


if __name__ == "__main__":
    main()
