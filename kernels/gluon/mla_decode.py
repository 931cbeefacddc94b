"""MLA decode for Hopper (sm_90a) in Gluon: warpgroup MMAs with the KV tokens on the M side.

One program handles the ROWS (query token, head) rows of one sequence against one split of
its keys, 64 keys per tile. Each tile is brought to shared memory once, as bf16, in four
parts: two "value" halves KA, KB [64, 256] and two rope parts RA, RB [64, 32]. Both products
read those parts where they lie:

    S^T [64, ROWS]   = KA QA^T + KB QB^T + RA QRA^T + RB QRB^T   (keys as M: wgmma's M >= 64)
    O_A [256, ROWS] += KA^T P^T,  O_B [256, ROWS] += KB^T P^T    (value dims as M)

bf16 tiles come by TMA straight into the parts (halves in natural order: dims 0-255,
256-511, 512-543, 544-575). MXFP4 tiles come by TMA as packed bytes into a ring of raw
stages and are decoded once per program and tile by all warps into the parts, split by
parity instead (A: even dims, B: odd dims), so a byte's two nibbles go to two parts with
no interleave: element 2i of a 32-value block is its byte i's low nibble. Q is split the
same way once per program; the output is put back in natural order when stored.

While the value product of one tile runs on the tensor cores, the warps decode the next
tile into the other of two part buffers. Splits write a normalized partial and its
log2-sum-exp in the layout of the Triton family's merge kernel, which combines them.
"""

from __future__ import annotations

from triton.runtime.jit import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from ..triton.mla_decode import _e2m1_ptx

FMT_BF16 = 0
FMT_FP8 = 1
FMT_MXFP4 = 2
BLOCK_N = gl.constexpr(64)
D_HALF = gl.constexpr(256)
D_ROPE_HALF = gl.constexpr(32)
D_QK = gl.constexpr(576)
D_V = gl.constexpr(512)

E2M1_PTX = gl.constexpr(_e2m1_ptx())
"""The Triton family's sm_90 E2M1 decode (kernels/triton/mla_decode.py, _E2M1_PTX)."""

E4M3_PTX = gl.constexpr(
    "{\n.reg .b32 a, b, k;\nmov.b32 k, 0x7B807B80;\n"
    "prmt.b32 a, $2, 0, 0x1404;\nprmt.b32 b, $2, 0, 0x3424;\n"
    "and.b32 $0, a, 0x7F007F00;\nshr.b32 $0, $0, 4;\nlop3.b32 $0, a, $0, 0x80008000, 0xEC;\n"
    "mul.rn.bf16x2 $0, $0, k;\n"
    "and.b32 $1, b, 0x7F007F00;\nshr.b32 $1, $1, 4;\nlop3.b32 $1, b, $1, 0x80008000, 0xEC;\n"
    "mul.rn.bf16x2 $1, $1, k;\n}")
"""sm_90 decode of four e4m3 bytes ($2) into bf16 ($0: bytes 0, 1; $1: bytes 2, 3): each
byte to the high byte of a 16-bit lane (prmt), exponent and mantissa shifted down by 4
into bf16's fields and the sign kept ((a & c) | b, lop3), which is the value times 2**-120
(subnormals included), then one multiply by 2**120: exact."""


@constexpr_function
def _s_layout(rows, num_warps):
    """The S^T accumulator's layout: 64 keys over 4 warps, the rows over the warpgroups."""
    wg = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wg],
                                     instr_shape=[16, rows // wg, 16])


@constexpr_function
def _o_layout(rows, num_warps):
    """The O accumulators' layout: 256 value dims over all warps, every row in each."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, rows, 16])


@constexpr_function
def _bf16_part(cols):
    return gl.NVMMASharedLayout.get_default_for([BLOCK_N, cols], gl.bfloat16)


@constexpr_function
def _q_part(rows, cols):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


@gluon.jit
def _decode_blocks(raw, sc, key_ok):
    """Packed E2M1 bytes raw [64, NB, W] (W bytes of each 16-byte block per thread) with
    their blocks' E8M0 scale bytes sc [64, NB] -> (low nibbles, high nibbles) as bf16
    [64, NB, W]. Keys outside the range (key_ok false) decode to zero whatever they hold."""
    s = sc.to(gl.int32)
    mult = gl.where(s == 0, 0x40, s << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
    mult = gl.where(key_ok[:, None], mult, 0.0)
    mult = gl.broadcast(gl.expand_dims(mult, 2), raw)[0]
    lo, hi = gl.inline_asm_elementwise(E2M1_PTX, "=r,=r,=r,=r,r,r,r", [raw, mult],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                                       pack=4)
    return lo, hi


@gluon.jit
def _decode_e4m3(raw):
    """e4m3 bytes (as uint8) -> bf16, elementwise (E4M3_PTX)."""
    return gl.inline_asm_elementwise(E4M3_PTX, "=r,=r,r", [raw], dtype=gl.bfloat16,
                                     is_pure=True, pack=4)


@gluon.jit
def _load_q_part(Q, grow, row_ok, d0, step, COLS: gl.constexpr, layout: gl.constexpr,
                 ROWS: gl.constexpr):
    """Query dims d0 + step * i (i < COLS) of rows `grow` as [ROWS, COLS] in `layout`."""
    offs_c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    ptr = Q + gl.expand_dims(grow, 1) * D_QK + d0 + step * gl.expand_dims(offs_c, 0)
    return gl.load(ptr, mask=gl.expand_dims(row_ok, 1), other=0.0)


@gluon.jit
def _store_rows(BASE, vals, rows_idx, row_ok, d0, step, layout: gl.constexpr):
    """vals [256, ROWS] (dims as M) into BASE[row, d0 + step * i]."""
    offs_i = gl.arange(0, D_HALF, layout=gl.SliceLayout(1, layout))
    ptr = BASE + gl.expand_dims(rows_idx, 0) * D_V + d0 + step * gl.expand_dims(offs_i, 1)
    gl.store(ptr, vals, mask=gl.expand_dims(row_ok, 0))


@gluon.jit
def _issue_tile(KD_A, KD_B, KD_RA, KD_RB, row0, bar, dst_a, dst_b, dst_ra, dst_rb, pred,
                FMT: gl.constexpr):
    """TMA copies of one tile's parts (rows row0..row0+63) into their buffers, completing
    on `bar`: bf16 straight into the operand buffers; fp8 bytes of the same four parts;
    MXFP4 packed value bytes [64, 256] and rope bytes [64, 32] (dst_b, dst_rb unused)."""
    if FMT == 2:
        mbarrier.expect(bar, KD_A.block_type.nbytes + KD_RA.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(KD_A, [row0, 0], bar, dst_a, pred=pred)
        tma.async_copy_global_to_shared(KD_RA, [row0, D_HALF], bar, dst_ra, pred=pred)
    else:
        mbarrier.expect(bar, 2 * KD_A.block_type.nbytes + 2 * KD_RA.block_type.nbytes,
                        pred=pred)
        tma.async_copy_global_to_shared(KD_A, [row0, 0], bar, dst_a, pred=pred)
        tma.async_copy_global_to_shared(KD_B, [row0, D_HALF], bar, dst_b, pred=pred)
        tma.async_copy_global_to_shared(KD_RA, [row0, 2 * D_HALF], bar, dst_ra, pred=pred)
        tma.async_copy_global_to_shared(KD_RB, [row0, 2 * D_HALF + D_ROPE_HALF], bar, dst_rb,
                                        pred=pred)


@constexpr_function
def _decode_layout(per_thread, threads, warps):
    """A layout of raw tile bytes for decoding: the warps split the 64 keys. A thread takes
    16 bytes (MXFP4: one 32-value block) of a key's value bytes, 8 of its rope bytes."""
    rank = len(per_thread)
    return gl.BlockedLayout(per_thread, threads, [warps] + [1] * (rank - 1),
                            list(range(rank - 1, -1, -1)))


@gluon.jit
def _program(QO_INDPTR, KV_INDPTR, H, n_splits, ROWS: gl.constexpr):
    """This program's sequence, row block and split: (split, q_start, q_len, rows, r0,
    kv_start, L, chunk, n_act); it has work when r0 < rows and split < n_act."""
    pid_m = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(QO_INDPTR + b)
    q_len = gl.load(QO_INDPTR + b + 1) - q_start
    kv_start = gl.load(KV_INDPTR + b)
    L = gl.load(KV_INDPTR + b + 1) - kv_start
    chunk = gl.cdiv(gl.cdiv(L, n_splits), BLOCK_N) * BLOCK_N
    return (split, q_start, q_len, q_len * H, pid_m * ROWS, kv_start, L, chunk,
            gl.cdiv(L, chunk))


@gluon.jit
def _key_range(split, chunk, L, q_len, r0, H, ROWS: gl.constexpr):
    """(lo, hi, n_tiles): the split's keys, cut at the last key the block's rows see."""
    j_max = gl.minimum((r0 + ROWS - 1) // H, q_len - 1)
    lo = split * chunk
    hi = gl.minimum(gl.minimum(lo + chunk, L), L - q_len + j_max + 1)
    return lo, hi, gl.cdiv(hi - lo, BLOCK_N)


@gluon.jit
def _q_to_shared(Q, q_start, r0, rows, H, FMT: gl.constexpr, ROWS: gl.constexpr,
                 num_warps: gl.constexpr):
    """The block's query rows in shared memory, once per program, in the parts' dim
    order: MXFP4's by parity (A: even dims, B: odd), the others' by halves."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    rows_q = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    grow_q = (q_start * H + rows_q).to(gl.int64)
    q_ok = rows_q < rows
    step: gl.constexpr = 2 if FMT == 2 else 1
    d_b: gl.constexpr = 1 if FMT == 2 else D_HALF
    d_rb: gl.constexpr = 513 if FMT == 2 else 2 * D_HALF + D_ROPE_HALF
    qa = _load_q_part(Q, grow_q, q_ok, 0, step, D_HALF, q_layout, ROWS)
    qb = _load_q_part(Q, grow_q, q_ok, d_b, step, D_HALF, q_layout, ROWS)
    qra = _load_q_part(Q, grow_q, q_ok, 2 * D_HALF, step, D_ROPE_HALF, q_layout, ROWS)
    qrb = _load_q_part(Q, grow_q, q_ok, d_rb, step, D_ROPE_HALF, q_layout, ROWS)
    qa_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_HALF], _q_part(ROWS, D_HALF), qa)
    qb_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_HALF], _q_part(ROWS, D_HALF), qb)
    qra_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_ROPE_HALF],
                                      _q_part(ROWS, D_ROPE_HALF), qra)
    qrb_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_ROPE_HALF],
                                      _q_part(ROWS, D_ROPE_HALF), qrb)
    return qa_s, qb_s, qra_s, qrb_s


@gluon.jit
def _mxfp4_scales(KV_SC, sc_stride, kv_start, n0, hi, WARPS: gl.constexpr):
    """Scale bytes of the tile at keys n0.. (rows of sc_stride bytes: not a TMA stride) in
    the decode layouts of `WARPS` warps: (value scales, their keys in range, rope scales,
    theirs)."""
    sv_layout: gl.constexpr = gl.SliceLayout(2, _decode_layout([1, 1, 16], [2, 16, 1], WARPS))
    sr_layout: gl.constexpr = gl.SliceLayout(2, _decode_layout([1, 1, 8], [8, 2, 2], WARPS))
    keys_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sv_layout))
    blk_v = gl.arange(0, 16, layout=gl.SliceLayout(0, sv_layout))
    keys_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sr_layout))
    blk_r = gl.arange(0, 2, layout=gl.SliceLayout(0, sr_layout))
    kv_ok = (n0 + keys_v) < hi
    sc_v = gl.load(KV_SC + gl.expand_dims((kv_start + n0 + keys_v).to(gl.int64), 1)
                   * sc_stride + gl.expand_dims(blk_v, 0), mask=gl.expand_dims(kv_ok, 1),
                   other=0)
    kr_ok = (n0 + keys_r) < hi
    sc_r = gl.load(KV_SC + gl.expand_dims((kv_start + n0 + keys_r).to(gl.int64), 1)
                   * sc_stride + 16 + gl.expand_dims(blk_r, 0), mask=gl.expand_dims(kr_ok, 1),
                   other=0)
    return sc_v, kv_ok, sc_r, kr_ok


@gluon.jit
def _raw_mxfp4(raw_a, raw_ra, WARPS: gl.constexpr):
    """A raw MXFP4 tile's value bytes [64, 16, 16] and rope bytes [64, 2, 16] out of shared
    memory, in the decode layouts of `WARPS` warps."""
    pv = raw_a.load(_decode_layout([1, 16], [2, 16], WARPS)).reshape([BLOCK_N, 16, 16])
    pr = raw_ra.load(_decode_layout([1, 8], [8, 4], WARPS)).reshape([BLOCK_N, 2, 16])
    return (gl.convert_layout(pv, _decode_layout([1, 1, 16], [2, 16, 1], WARPS)),
            gl.convert_layout(pr, _decode_layout([1, 1, 8], [8, 2, 2], WARPS)))


@gluon.jit
def _decode_mxfp4(pv, pr, scales):
    """Raw bytes (_raw_mxfp4) and their scales (_mxfp4_scales) -> the four bf16 parts."""
    sc_v, kv_ok, sc_r, kr_ok = scales
    va, vb = _decode_blocks(pv, sc_v, kv_ok)
    ra, rb = _decode_blocks(pr, sc_r, kr_ok)
    return (va.reshape([BLOCK_N, D_HALF]), vb.reshape([BLOCK_N, D_HALF]),
            ra.reshape([BLOCK_N, D_ROPE_HALF]), rb.reshape([BLOCK_N, D_ROPE_HALF]))


@gluon.jit
def _issue_scores(ka, kb, kra, krb, q_parts, acc_s):
    """S^T = K Q^T of one tile's parts, issued async (acc_s: its accumulator)."""
    qa_s, qb_s, qra_s, qrb_s = q_parts
    acc_s = warpgroup_mma(ka, qa_s.permute((1, 0)), acc_s, use_acc=False, is_async=True)
    acc_s = warpgroup_mma(kb, qb_s.permute((1, 0)), acc_s, is_async=True)
    acc_s = warpgroup_mma(kra, qra_s.permute((1, 0)), acc_s, is_async=True)
    return warpgroup_mma(krb, qrb_s.permute((1, 0)), acc_s, is_async=True)


@gluon.jit
def _mma_start(ROWS: gl.constexpr, num_warps: gl.constexpr):
    """The MMA side's state before the first tile: (running max, running sum, O_A, O_B,
    the S^T accumulator, the tile's key offsets on S's M side)."""
    s_layout: gl.constexpr = _s_layout(ROWS, num_warps)
    o_layout: gl.constexpr = _o_layout(ROWS, num_warps)
    m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, s_layout))
    o_a = warpgroup_mma_init(gl.zeros([D_HALF, ROWS], gl.float32, layout=o_layout))
    o_b = warpgroup_mma_init(gl.zeros([D_HALF, ROWS], gl.float32, layout=o_layout))
    acc_s = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=s_layout)
    keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    return m_i, l_i, o_a, o_b, acc_s, keys_s


@gluon.jit
def _softmax_and_values(acc_s, ka, kb, p_s, state, key, hi, limit, scale,
                        o_layout: gl.constexpr):
    """Online softmax of a tile's finished scores (keys `key` on the M side, log2 domain),
    P to shared memory, the running output rescaled and the value product O^T += V^T P^T
    issued async. state and the result: (O_A, O_B, m, l)."""
    o_a, o_b, m_i, l_i = state
    valid = (gl.expand_dims(key, 1) < hi) & (gl.expand_dims(key, 1) <= gl.expand_dims(limit, 0))
    s = gl.where(valid, acc_s * scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 0))
    l_i = l_i * alpha + gl.sum(p, axis=0)
    p_s.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))
    o_a = o_a * gl.expand_dims(alpha_o, 0)
    o_b = o_b * gl.expand_dims(alpha_o, 0)
    o_a = warpgroup_mma(ka.permute((1, 0)), p_s.permute((1, 0)), o_a, is_async=True)
    o_b = warpgroup_mma(kb.permute((1, 0)), p_s.permute((1, 0)), o_b, is_async=True)
    return o_a, o_b, m_new, l_i


@gluon.jit
def _write_block(state, out_scale, OUT, PART_O, PART_LSE, q_start, H, r0, rows, split,
                 total_rows, n_act, FMT: gl.constexpr, ROWS: gl.constexpr,
                 num_warps: gl.constexpr):
    """Normalize the block's output; write it (one split) or a partial and its
    log2-sum-exp, in the parts' dim order (_q_to_shared)."""
    o_a, o_b, m_i, l_i = state
    s_layout: gl.constexpr = _s_layout(ROWS, num_warps)
    o_layout: gl.constexpr = _o_layout(ROWS, num_warps)
    step: gl.constexpr = 2 if FMT == 2 else 1
    d_b: gl.constexpr = 1 if FMT == 2 else D_HALF
    rows_o = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, o_layout))
    row_ok = rows_o < rows
    l_o = gl.convert_layout(l_i, gl.SliceLayout(0, o_layout))
    inv = gl.expand_dims(out_scale / gl.where(l_o > 0, l_o, 1.0), 0)
    o_a = o_a * inv
    o_b = o_b * inv
    grow = (q_start * H + rows_o).to(gl.int64)
    if n_act == 1:
        _store_rows(OUT, o_a.to(gl.bfloat16), grow, row_ok, 0, step, o_layout)
        _store_rows(OUT, o_b.to(gl.bfloat16), grow, row_ok, d_b, step, o_layout)
    else:
        prow = split * total_rows + grow
        _store_rows(PART_O, o_a, prow, row_ok, 0, step, o_layout)
        _store_rows(PART_O, o_b, prow, row_ok, d_b, step, o_layout)
        rows_l = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
        gl.store(PART_LSE + split * total_rows + q_start * H + rows_l,
                 m_i + gl.log2(l_i), mask=rows_l < rows)


@gluon.jit
def mla_decode_gluon_kernel(
    Q, KD_A, KD_B, KD_RA, KD_RB, KV_SCALE, KV_SC, sc_stride,
    QO_INDPTR, KV_INDPTR, OUT, PART_O, PART_LSE,
    H, total_rows, n_splits, qk_scale,
    FMT: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, BUFS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Grid (row blocks, splits, batch). KD_*: TMA descriptors of the tile parts over the
    whole cache (bf16 [tokens, 576] and fp8 bytes [tokens, 576]: blocks [64, 256] at
    columns 0 and 256, [64, 32] at 512 and 544; MXFP4 bytes [tokens, 288]: [64, 256] at 0,
    [64, 32] at 256, KD_B and KD_RB unused). KV_SCALE: fp8's per-tensor scale; KV_SC,
    sc_stride: MXFP4's scale rows. STAGES: tiles in flight; BUFS: decoded part buffers
    (fp8, MXFP4: 2 lets a tile be decoded while the last one's value product runs)."""
    split, q_start, q_len, rows, r0, kv_start, L, chunk, n_act = _program(
        QO_INDPTR, KV_INDPTR, H, n_splits, ROWS)
    if (r0 < rows) & (split < n_act):
        s_layout: gl.constexpr = _s_layout(ROWS, num_warps)
        o_layout: gl.constexpr = _o_layout(ROWS, num_warps)
        ka_layout: gl.constexpr = _bf16_part(D_HALF)
        kr_layout: gl.constexpr = _bf16_part(D_ROPE_HALF)

        # Rows of this block, their causal limits (inclusive) and the keys to visit.
        rows_s = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
        limit = L - q_len + rows_s // H
        lo, hi, n_tiles = _key_range(split, chunk, L, q_len, r0, H, ROWS)
        scale = qk_scale
        out_scale = 1.0
        if FMT == 1:
            kv_scale = gl.load(KV_SCALE)
            scale = qk_scale * kv_scale
            out_scale = kv_scale
        q_parts = _q_to_shared(Q, q_start, r0, rows, H, FMT, ROWS, num_warps)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, BLOCK_N], _q_part(ROWS, BLOCK_N))

        # The bf16 parts: the TMA ring itself (bf16), or BUFS buffers decoded into.
        NBUF: gl.constexpr = STAGES if FMT == 0 else BUFS
        ka_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D_HALF], ka_layout)
        kb_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D_HALF], ka_layout)
        kra_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D_ROPE_HALF], kr_layout)
        krb_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BLOCK_N, D_ROPE_HALF], kr_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        # Raw tiles: bf16 lands in the parts; fp8 and MXFP4 in a ring of byte tiles.
        raw_a = ka_s
        raw_b = kb_s
        raw_ra = kra_s
        raw_rb = krb_s
        if FMT != 0:
            raw_a = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D_HALF], KD_A.layout)
            raw_ra = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D_ROPE_HALF],
                                               KD_RA.layout)
            raw_b = raw_a
            raw_rb = raw_ra
            if FMT == 1:
                raw_b = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D_HALF],
                                                  KD_A.layout)
                raw_rb = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D_ROPE_HALF],
                                                   KD_RA.layout)
        fence_async_shared()

        # Prologue: the first STAGES - 1 tiles in flight.
        for i in gl.static_range(STAGES - 1):
            _issue_tile(KD_A, KD_B, KD_RA, KD_RB, (kv_start + lo + i * BLOCK_N).to(gl.int32),
                        bars.index(i), raw_a.index(i), raw_b.index(i), raw_ra.index(i),
                        raw_rb.index(i), i < n_tiles, FMT)

        m_i, l_i, o_a, o_b, acc_s, keys_s = _mma_start(ROWS, num_warps)
        rv2: gl.constexpr = _decode_layout([1, 16], [2, 16], num_warps)
        rr2: gl.constexpr = _decode_layout([1, 8], [8, 4], num_warps)

        for t in range(0, n_tiles):
            slot = t % STAGES
            n0 = lo + t * BLOCK_N
            nt = t + STAGES - 1
            nrow = (kv_start + lo + nt * BLOCK_N).to(gl.int32)
            nslot = nt % STAGES
            if FMT == 0:
                # The next tile's slot holds tile t - 1: its value product must be done.
                o_a, o_b = warpgroup_mma_wait(0, deps=(o_a, o_b))
            # (fp8, MXFP4: that slot's bytes were read in the last iteration, before its
            # barriers.)
            _issue_tile(KD_A, KD_B, KD_RA, KD_RB, nrow, bars.index(nslot), raw_a.index(nslot),
                        raw_b.index(nslot), raw_ra.index(nslot), raw_rb.index(nslot),
                        nt < n_tiles, FMT)
            buf = slot
            if FMT == 2:
                scales = _mxfp4_scales(KV_SC, sc_stride, kv_start, n0, hi, num_warps)
            mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
            if FMT != 0:
                buf = t % BUFS
                if BUFS == 1:
                    # The single part buffer is read by the last value product.
                    o_a, o_b = warpgroup_mma_wait(0, deps=(o_a, o_b))
                if FMT == 2:
                    pv, pr = _raw_mxfp4(raw_a.index(slot), raw_ra.index(slot), num_warps)
                    va, vb, ra, rb = _decode_mxfp4(pv, pr, scales)
                else:
                    va = _decode_e4m3(raw_a.index(slot).load(rv2))
                    vb = _decode_e4m3(raw_b.index(slot).load(rv2))
                    ra = _decode_e4m3(raw_ra.index(slot).load(rr2))
                    rb = _decode_e4m3(raw_rb.index(slot).load(rr2))
                ka_s.index(buf).store(va)
                kb_s.index(buf).store(vb)
                kra_s.index(buf).store(ra)
                krb_s.index(buf).store(rb)
                fence_async_shared()
                gl.thread_barrier()
            ka = ka_s.index(buf)
            kb = kb_s.index(buf)
            acc_s = _issue_scores(ka, kb, kra_s.index(buf), krb_s.index(buf), q_parts, acc_s)
            acc_s, o_a, o_b = warpgroup_mma_wait(0, deps=(acc_s, o_a, o_b))
            o_a, o_b, m_i, l_i = _softmax_and_values(acc_s, ka, kb, p_s, (o_a, o_b, m_i, l_i),
                                                     n0 + keys_s, hi, limit, scale, o_layout)
        o_a, o_b = warpgroup_mma_wait(0, deps=(o_a, o_b))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        _write_block((o_a, o_b, m_i, l_i), out_scale, OUT, PART_O, PART_LSE, q_start, H, r0,
                     rows, split, total_rows, n_act, FMT, ROWS, num_warps)

def descriptors(kv_format: str, kv, rows_total: int):
    """Host TMA descriptors of the tile parts over the whole cache (see the kernel)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bn, half, rope, dqk = BLOCK_N.value, D_HALF.value, D_ROPE_HALF.value, D_QK.value
    if kv_format == "mxfp4":
        packed = kv.view(rows_total, dqk // 2)
        raw = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        a = TensorDescriptor(packed, [rows_total, dqk // 2], [dqk // 2, 1],
                             [bn, half], raw)
        r = TensorDescriptor(packed, [rows_total, dqk // 2], [dqk // 2, 1],
                             [bn, rope], raw)
        return a, a, r, r
    if kv_format == "fp8":
        flat = kv.view(torch.uint8).view(rows_total, dqk)
        raw = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        a = TensorDescriptor(flat, [rows_total, dqk], [dqk, 1], [bn, half], raw)
        r = TensorDescriptor(flat, [rows_total, dqk], [dqk, 1], [bn, rope], raw)
        return a, a, r, r
    flat = kv.view(rows_total, dqk)
    a = TensorDescriptor(flat, [rows_total, dqk], [dqk, 1], [bn, half],
                         gl.NVMMASharedLayout.get_default_for([bn, half], gl.bfloat16))
    r = TensorDescriptor(flat, [rows_total, dqk], [dqk, 1], [bn, rope],
                         gl.NVMMASharedLayout.get_default_for([bn, rope],
                                                              gl.bfloat16))
    return a, a, r, r
