"""The Gluon Hopper kernel of mla_decode.py for MXFP4 with its tile decode moved to warps of
its own (warp specialization), so decoding overlaps the whole MMA chain instead of only the
value product. (fp8 has no such variant: its decoded parts fit shared memory only one
buffer deep, and with one buffer the decode of the next tile waits for this tile's value
product, so nothing would overlap.)

Partitions of one program: the default partition (one warpgroup) runs S, the softmax and
the value product per tile and the epilogue; a 1-warp loader issues the TMA copies of raw
tiles into a ring (`raw_ready` / `raw_empty` barriers); 4 or 8 decoding warps turn each raw tile
into the bf16 operand parts, two buffers deep (`k_ready` / `k_empty`). Layout of parts,
operands and partials as in mla_decode.py.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.runtime.jit import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .mla_decode import (
    BLOCK_N,
    FMT_MXFP4,
    D_HALF,
    D_ROPE_HALF,
    _bf16_part,
    _decode_blocks,
    _decode_e4m3,
    _issue_tile,
    _load_q_part,
    _o_layout,
    _q_part,
    _s_layout,
    _store_rows,
)

MXFP4 = gl.constexpr(FMT_MXFP4)


@constexpr_function
def _decode_layout(per_thread, threads, decode_warps):
    """A decoding partition's layout of raw tile bytes: its warps split the 64 keys."""
    rank = len(per_thread)
    return gl.BlockedLayout(per_thread, threads, [decode_warps] + [1] * (rank - 1),
                            list(range(rank - 1, -1, -1)))


@gluon.jit
def _load_partition(KD_A, KD_B, KD_RA, KD_RB, KV_SC, sc_stride, kv_start, lo, hi, n_tiles,
                    raw, parts, bars):
    """Issue tile t's TMA copies once its raw slot is free."""
    raw_a, raw_b, raw_ra, raw_rb = raw
    raw_ready, raw_empty, k_ready, k_empty = bars
    STAGES: gl.constexpr = raw_a.type.shape[0]
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(raw_empty.index(s), ((t // STAGES) & 1) ^ 1)
        _issue_tile(KD_A, KD_B, KD_RA, KD_RB, (kv_start + lo + t * BLOCK_N).to(gl.int32),
                    raw_ready.index(s), raw_a.index(s), raw_b.index(s), raw_ra.index(s),
                    raw_rb.index(s), True, MXFP4)


@gluon.jit
def _decode_partition(KD_A, KD_B, KD_RA, KD_RB, KV_SC, sc_stride, kv_start, lo, hi, n_tiles,
                      raw, parts, bars):
    """Decode raw tile t into part buffer t % 2 once the value product two tiles back has
    released it; release the raw slot as soon as its bytes are in registers."""
    raw_a, raw_b, raw_ra, raw_rb = raw
    ka_s, kb_s, kra_s, krb_s = parts
    raw_ready, raw_empty, k_ready, k_empty = bars
    STAGES: gl.constexpr = raw_a.type.shape[0]
    NBUF: gl.constexpr = ka_s.type.shape[0]
    DW: gl.constexpr = gl.num_warps()
    rv_layout: gl.constexpr = _decode_layout([1, 1, 16], [2, 16, 1], DW)
    rr_layout: gl.constexpr = _decode_layout([1, 1, 8], [8, 2, 2], DW)
    rv2: gl.constexpr = _decode_layout([1, 16], [2, 16], DW)
    rr2: gl.constexpr = _decode_layout([1, 8], [8, 4], DW)
    sv_layout: gl.constexpr = gl.SliceLayout(2, rv_layout)
    sr_layout: gl.constexpr = gl.SliceLayout(2, rr_layout)
    keys_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sv_layout))
    blk_v = gl.arange(0, 16, layout=gl.SliceLayout(0, sv_layout))
    keys_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sr_layout))
    blk_r = gl.arange(0, 2, layout=gl.SliceLayout(0, sr_layout))
    for t in range(n_tiles):
        s = t % STAGES
        b = t % NBUF
        n0 = lo + t * BLOCK_N
        kv_ok = (n0 + keys_v) < hi
        sc_v = gl.load(KV_SC + gl.expand_dims((kv_start + n0 + keys_v).to(gl.int64), 1)
                       * sc_stride + gl.expand_dims(blk_v, 0),
                       mask=gl.expand_dims(kv_ok, 1), other=0)
        kr_ok = (n0 + keys_r) < hi
        sc_r = gl.load(KV_SC + gl.expand_dims((kv_start + n0 + keys_r).to(gl.int64), 1)
                       * sc_stride + 16 + gl.expand_dims(blk_r, 0),
                       mask=gl.expand_dims(kr_ok, 1), other=0)
        mbarrier.wait(raw_ready.index(s), (t // STAGES) & 1)
        pv = gl.convert_layout(raw_a.index(s).load(rv2).reshape([BLOCK_N, 16, 16]),
                               rv_layout)
        pr = gl.convert_layout(raw_ra.index(s).load(rr2).reshape([BLOCK_N, 2, 16]),
                               rr_layout)
        fence_async_shared()  # the slot's reads before the loader's next TMA into it
        mbarrier.arrive(raw_empty.index(s), count=1)
        va, vb = _decode_blocks(pv, sc_v, kv_ok)
        ra, rb = _decode_blocks(pr, sc_r, kr_ok)
        va = va.reshape([BLOCK_N, D_HALF])
        vb = vb.reshape([BLOCK_N, D_HALF])
        ra = ra.reshape([BLOCK_N, D_ROPE_HALF])
        rb = rb.reshape([BLOCK_N, D_ROPE_HALF])
        mbarrier.wait(k_empty.index(b), ((t // NBUF) & 1) ^ 1)
        ka_s.index(b).store(va)
        kb_s.index(b).store(vb)
        kra_s.index(b).store(ra)
        krb_s.index(b).store(rb)
        fence_async_shared()
        mbarrier.arrive(k_ready.index(b), count=1)


@gluon.jit
def _mma_partition(qa_s, qb_s, qra_s, qrb_s, p_s, parts, bars, n_tiles, lo, hi, limit, scale,
                   ROWS: gl.constexpr, num_warps: gl.constexpr):
    """S, online softmax and the value product per decoded tile; returns (O_A, O_B, m, l)."""
    ka_s, kb_s, kra_s, krb_s = parts
    raw_ready, raw_empty, k_ready, k_empty = bars
    NBUF: gl.constexpr = ka_s.type.shape[0]
    s_layout: gl.constexpr = _s_layout(ROWS, num_warps)
    o_layout: gl.constexpr = _o_layout(ROWS, num_warps)
    m_i = gl.full([ROWS], -1.0e30, gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, s_layout))
    o_a = warpgroup_mma_init(gl.zeros([D_HALF, ROWS], gl.float32, layout=o_layout))
    o_b = warpgroup_mma_init(gl.zeros([D_HALF, ROWS], gl.float32, layout=o_layout))
    acc_s = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=s_layout)
    keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    for t in range(n_tiles):
        b = t % NBUF
        mbarrier.wait(k_ready.index(b), (t // NBUF) & 1)
        ka = ka_s.index(b)
        kb = kb_s.index(b)
        acc_s = warpgroup_mma(ka, qa_s.permute((1, 0)), acc_s, use_acc=False, is_async=True)
        acc_s = warpgroup_mma(kb, qb_s.permute((1, 0)), acc_s, is_async=True)
        acc_s = warpgroup_mma(kra_s.index(b), qra_s.permute((1, 0)), acc_s, is_async=True)
        acc_s = warpgroup_mma(krb_s.index(b), qrb_s.permute((1, 0)), acc_s, is_async=True)
        acc_s, o_a, o_b = warpgroup_mma_wait(0, deps=(acc_s, o_a, o_b))
        # The last tile's value product is done: its parts may be decoded over.
        mbarrier.arrive(k_empty.index((t + NBUF - 1) % NBUF), count=1, pred=t > 0)
        key = lo + t * BLOCK_N + keys_s
        valid = (gl.expand_dims(key, 1) < hi) & \
            (gl.expand_dims(key, 1) <= gl.expand_dims(limit, 0))
        s = gl.where(valid, acc_s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_s.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))
        o_a = o_a * gl.expand_dims(alpha_o, 0)
        o_b = o_b * gl.expand_dims(alpha_o, 0)
        o_a = warpgroup_mma(ka.permute((1, 0)), p_s.permute((1, 0)), o_a, is_async=True)
        o_b = warpgroup_mma(kb.permute((1, 0)), p_s.permute((1, 0)), o_b, is_async=True)
    o_a, o_b = warpgroup_mma_wait(0, deps=(o_a, o_b))
    return o_a, o_b, m_i, l_i


@gluon.jit
def mla_decode_gluon_ws_kernel(
    Q, KD_A, KD_B, KD_RA, KD_RB, KV_SCALE, KV_SC, sc_stride,
    QO_INDPTR, KV_INDPTR, OUT, PART_O, PART_LSE,
    H, total_rows, n_splits, qk_scale,
    FMT: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr, BUFS: gl.constexpr,
    DW: gl.constexpr, num_warps: gl.constexpr,
):
    """mla_decode_gluon_kernel's contract for MXFP4, warp-specialized: DW decoding warps (4
    or 8); num_warps is the MMA partition's (4). Two part buffers at least: with one,
    decoding tile t + 1 would wait for tile t's value product, which waits for the release
    that tile t + 1's S gives."""
    gl.static_assert(FMT == MXFP4, "the warp-specialized kernel decodes MXFP4 only")
    gl.static_assert(BUFS >= 2, "the warp-specialized kernel needs two part buffers")
    gl.static_assert((DW == 4) | (DW == 8), "4 or 8 decoding warps")
    DECODE_REGS: gl.constexpr = 168 if DW == 4 else 120
    pid_m = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(QO_INDPTR + b)
    q_len = gl.load(QO_INDPTR + b + 1) - q_start
    rows = q_len * H
    r0 = pid_m * ROWS
    kv_start = gl.load(KV_INDPTR + b)
    L = gl.load(KV_INDPTR + b + 1) - kv_start
    chunk = gl.cdiv(gl.cdiv(L, n_splits), BLOCK_N) * BLOCK_N
    n_act = gl.cdiv(L, chunk)
    if (r0 < rows) & (split < n_act):
        s_layout: gl.constexpr = _s_layout(ROWS, num_warps)
        o_layout: gl.constexpr = _o_layout(ROWS, num_warps)
        q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        rows_q = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
        grow_q = (q_start * H + rows_q).to(gl.int64)
        rows_s = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
        limit = L - q_len + rows_s // H
        j_max = gl.minimum((r0 + ROWS - 1) // H, q_len - 1)
        lo = split * chunk
        hi = gl.minimum(gl.minimum(lo + chunk, L), L - q_len + j_max + 1)
        n_tiles = gl.cdiv(hi - lo, BLOCK_N)
        q_ok = rows_q < rows
        # MXFP4 parts hold the even and odd dims (mla_decode.py).
        qa = _load_q_part(Q, grow_q, q_ok, 0, 2, D_HALF, q_layout, ROWS)
        qb = _load_q_part(Q, grow_q, q_ok, 1, 2, D_HALF, q_layout, ROWS)
        qra = _load_q_part(Q, grow_q, q_ok, 512, 2, D_ROPE_HALF, q_layout, ROWS)
        qrb = _load_q_part(Q, grow_q, q_ok, 513, 2, D_ROPE_HALF, q_layout, ROWS)
        qa_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_HALF], _q_part(ROWS, D_HALF), qa)
        qb_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_HALF], _q_part(ROWS, D_HALF), qb)
        qra_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_ROPE_HALF],
                                          _q_part(ROWS, D_ROPE_HALF), qra)
        qrb_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_ROPE_HALF],
                                          _q_part(ROWS, D_ROPE_HALF), qrb)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, BLOCK_N], _q_part(ROWS, BLOCK_N))
        ka_s = gl.allocate_shared_memory(gl.bfloat16, [BUFS, BLOCK_N, D_HALF], _bf16_part(D_HALF))
        kb_s = gl.allocate_shared_memory(gl.bfloat16, [BUFS, BLOCK_N, D_HALF], _bf16_part(D_HALF))
        kra_s = gl.allocate_shared_memory(gl.bfloat16, [BUFS, BLOCK_N, D_ROPE_HALF],
                                          _bf16_part(D_ROPE_HALF))
        krb_s = gl.allocate_shared_memory(gl.bfloat16, [BUFS, BLOCK_N, D_ROPE_HALF],
                                          _bf16_part(D_ROPE_HALF))
        raw_a = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D_HALF], KD_A.layout)
        raw_ra = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D_ROPE_HALF],
                                           KD_RA.layout)
        raw_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        raw_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [BUFS, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [BUFS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(raw_ready.index(i), count=1)
            mbarrier.init(raw_empty.index(i), count=1)
        for i in gl.static_range(BUFS):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=1)
        fence_async_shared()
        raw = (raw_a, raw_a, raw_ra, raw_ra)  # MXFP4 has no second raw part
        parts = (ka_s, kb_s, kra_s, krb_s)
        bars = (raw_ready, raw_empty, k_ready, k_empty)
        worker_args = (KD_A, KD_B, KD_RA, KD_RB, KV_SC, sc_stride, kv_start, lo, hi, n_tiles,
                       raw, parts, bars)
        o_a, o_b, m_i, l_i = gl.warp_specialize([
            (_mma_partition, (qa_s, qb_s, qra_s, qrb_s, p_s, parts, bars, n_tiles, lo, hi,
                              limit, qk_scale, ROWS, num_warps)),
            (_load_partition, worker_args),
            (_decode_partition, worker_args),
        ], [1, DW], [24, DECODE_REGS])

        rows_o = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, o_layout))
        row_ok = rows_o < rows
        l_o = gl.convert_layout(l_i, gl.SliceLayout(0, o_layout))
        inv = gl.expand_dims(1.0 / gl.where(l_o > 0, l_o, 1.0), 0)
        o_a = o_a * inv
        o_b = o_b * inv
        grow = (q_start * H + rows_o).to(gl.int64)
        if n_act == 1:
            _store_rows(OUT, o_a.to(gl.bfloat16), grow, row_ok, 0, 2, o_layout)
            _store_rows(OUT, o_b.to(gl.bfloat16), grow, row_ok, 1, 2, o_layout)
        else:
            prow = split * total_rows + grow
            _store_rows(PART_O, o_a, prow, row_ok, 0, 2, o_layout)
            _store_rows(PART_O, o_b, prow, row_ok, 1, 2, o_layout)
            rows_l = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
            gl.store(PART_LSE + split * total_rows + q_start * H + rows_l,
                     m_i + gl.log2(l_i), mask=rows_l < rows)
