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
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma_wait,
)

from .mla_decode import (
    BLOCK_N,
    D_HALF,
    D_ROPE_HALF,
    FMT_MXFP4,
    _bf16_part,
    _decode_mxfp4,
    _issue_scores,
    _issue_tile,
    _key_range,
    _mma_start,
    _mxfp4_scales,
    _o_layout,
    _program,
    _q_part,
    _q_to_shared,
    _raw_mxfp4,
    _s_layout,
    _softmax_and_values,
    _write_block,
)

MXFP4 = gl.constexpr(FMT_MXFP4)


@gluon.jit
def _load_partition(KD_A, KD_RA, KV_SC, sc_stride, kv_start, lo, hi, n_tiles, raw, parts,
                    bars):
    """Issue tile t's TMA copies once its raw slot is free."""
    raw_a, raw_ra = raw
    raw_ready, raw_empty, k_ready, k_empty = bars
    STAGES: gl.constexpr = raw_a.type.shape[0]
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(raw_empty.index(s), ((t // STAGES) & 1) ^ 1)
        # MXFP4 has no second raw part: its slots stand in for the unused ones.
        _issue_tile(KD_A, KD_A, KD_RA, KD_RA, (kv_start + lo + t * BLOCK_N).to(gl.int32),
                    raw_ready.index(s), raw_a.index(s), raw_a.index(s), raw_ra.index(s),
                    raw_ra.index(s), True, MXFP4)


@gluon.jit
def _decode_partition(KD_A, KD_RA, KV_SC, sc_stride, kv_start, lo, hi, n_tiles, raw, parts,
                      bars):
    """Decode raw tile t into part buffer t % 2 once the value product two tiles back has
    released it; release the raw slot as soon as its bytes are in registers."""
    raw_a, raw_ra = raw
    ka_s, kb_s, kra_s, krb_s = parts
    raw_ready, raw_empty, k_ready, k_empty = bars
    STAGES: gl.constexpr = raw_a.type.shape[0]
    NBUF: gl.constexpr = ka_s.type.shape[0]
    DW: gl.constexpr = gl.num_warps()
    for t in range(n_tiles):
        s = t % STAGES
        b = t % NBUF
        scales = _mxfp4_scales(KV_SC, sc_stride, kv_start, lo + t * BLOCK_N, hi, DW)
        mbarrier.wait(raw_ready.index(s), (t // STAGES) & 1)
        pv, pr = _raw_mxfp4(raw_a.index(s), raw_ra.index(s), DW)
        fence_async_shared()  # the slot's reads before the loader's next TMA into it
        mbarrier.arrive(raw_empty.index(s), count=1)
        va, vb, ra, rb = _decode_mxfp4(pv, pr, scales)
        mbarrier.wait(k_empty.index(b), ((t // NBUF) & 1) ^ 1)
        ka_s.index(b).store(va)
        kb_s.index(b).store(vb)
        kra_s.index(b).store(ra)
        krb_s.index(b).store(rb)
        fence_async_shared()
        mbarrier.arrive(k_ready.index(b), count=1)


@gluon.jit
def _mma_partition(q_parts, p_s, parts, bars, n_tiles, lo, hi, limit, scale,
                   ROWS: gl.constexpr, num_warps: gl.constexpr):
    """S, online softmax and the value product per decoded tile; returns (O_A, O_B, m, l)."""
    ka_s, kb_s, kra_s, krb_s = parts
    raw_ready, raw_empty, k_ready, k_empty = bars
    NBUF: gl.constexpr = ka_s.type.shape[0]
    o_layout: gl.constexpr = _o_layout(ROWS, num_warps)
    m_i, l_i, o_a, o_b, acc_s, keys_s = _mma_start(ROWS, num_warps)
    for t in range(n_tiles):
        b = t % NBUF
        mbarrier.wait(k_ready.index(b), (t // NBUF) & 1)
        ka = ka_s.index(b)
        kb = kb_s.index(b)
        acc_s = _issue_scores(ka, kb, kra_s.index(b), krb_s.index(b), q_parts, acc_s)
        acc_s, o_a, o_b = warpgroup_mma_wait(0, deps=(acc_s, o_a, o_b))
        # The last tile's value product is done: its parts may be decoded over.
        mbarrier.arrive(k_empty.index((t + NBUF - 1) % NBUF), count=1, pred=t > 0)
        o_a, o_b, m_i, l_i = _softmax_and_values(acc_s, ka, kb, p_s, (o_a, o_b, m_i, l_i),
                                                 lo + t * BLOCK_N + keys_s, hi, limit, scale,
                                                 o_layout)
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
    split, q_start, q_len, rows, r0, kv_start, L, chunk, n_act = _program(
        QO_INDPTR, KV_INDPTR, H, n_splits, ROWS)
    if (r0 < rows) & (split < n_act):
        s_layout: gl.constexpr = _s_layout(ROWS, num_warps)
        rows_s = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
        limit = L - q_len + rows_s // H
        lo, hi, n_tiles = _key_range(split, chunk, L, q_len, r0, H, ROWS)
        q_parts = _q_to_shared(Q, q_start, r0, rows, H, MXFP4, ROWS, num_warps)
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
        parts = (ka_s, kb_s, kra_s, krb_s)
        bars = (raw_ready, raw_empty, k_ready, k_empty)
        worker_args = (KD_A, KD_RA, KV_SC, sc_stride, kv_start, lo, hi, n_tiles,
                       (raw_a, raw_ra), parts, bars)
        state = gl.warp_specialize([
            (_mma_partition, (q_parts, p_s, parts, bars, n_tiles, lo, hi, limit, qk_scale,
                              ROWS, num_warps)),
            (_load_partition, worker_args),
            (_decode_partition, worker_args),
        ], [1, DW], [24, DECODE_REGS])
        _write_block(state, 1.0, OUT, PART_O, PART_LSE, q_start, H, r0, rows, split,
                     total_rows, n_act, MXFP4, ROWS, num_warps)
