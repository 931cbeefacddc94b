"""MLA decode (absorbed form) as one Triton kernel family for NVIDIA sm_90 and AMD gfx950.

One program handles BLOCK_M consecutive (query token, head) rows of one sequence and one
KV split. Rows of a sequence are contiguous in `q` and in the output ((token, head) order),
so a block of rows is a plain slice. Each KV tile of BLOCK_N tokens is read once in its
stored format and feeds both products: keys use all 576 dims (512 "nope" + 64 "rope"),
values the first 512 of the same rows.

Formats (KV_FMT): bf16; fp8 e4m3 with a per-tensor scale; MXFP4 (E2M1 nibbles, element 2i
in the low nibble, E8M0 scale byte per 32 elements, scale rows read with their own stride).
Compute paths (COMPUTE): what operands reach the matrix units. bf16/fp16 convert the KV
tile; fp8 quantizes each Q row to e4m3 (scale folded into the softmax scale) and P to e4m3
(power-of-two scale folded into the normalizer), so e4m3 KV feeds the MMA unconverted;
fp8qk does QK^T that way but P V on fp16 (e4m3 MMAs take K-major operands only, and V's
contraction runs over tokens, across the stored rows).

fp8 P V: the e4m3 A operand (value dims as M, keys as K) needs four consecutive keys of one
dim per register, i.e. the tile transposed. Each thread owns 16 rows of that operand; in
natural dim order they are 16 scattered dims, and the transpose went through shared memory
one byte at a time. _dims_interleaved reorders the dims (a free relabelling of the M side)
so a thread's 16 rows are 16 consecutive dims: one 16-byte read per key, transposed in
registers with byte permutes, and the output is stored at the reordered dims.

MMA orientation: bf16/fp8 products run transposed, with keys (QK^T) and value dims (P V)
as the M side and the query rows as N: the KV tile is the A operand straight from shared
memory and Hopper can use wgmma, which needs M >= 64. A 32-key tile's QK^T is the
exception: it runs on mma.sync with the query rows as M, so each warp owns its own keys
(with keys as M, pairs of warps computed the same half). MXFP4 keeps the query rows as M
for both products: the decoded tile is the B operand, written to shared memory once in a
dims-major layout (16-byte stores) and read by both.

KV loads (TMA): bf16/fp8 tiles of the contiguous cache come either through pointers
(masked loads, a cp.async ring on sm_90) or through tensor descriptors (the TMA unit on
sm_90: a few bulk copies per tile instead of per-thread 16-byte copies). A tile must not
bring in rows past its program's last key: TMA fills rows past a descriptor's end with
zeros (a zero times p = 0 is 0), while a row of another sequence could hold anything, NaN
included. So each program makes its own pair of descriptors, ending where its split ends
(TMA_KERNEL_DESC, kv_load='tma'). Where every tile a program reads ends inside its own keys
(one query per sequence, every length a multiple of BLOCK_N: the suites' shapes), one pair
of descriptors over the whole cache can instead be made on the host and passed in
(TMA_HOST_DESC, kv_load='tma_host'). Neither is faster everywhere on the H200: host-made
descriptors saved 0.4-2.8 us at 18 of the 28 bf16/fp8 suite shapes and cost 3.5-24 us at
the longest launches (bf16 64x8192 and 256x8192, fp8 128x8192 and 256x8192;
docs/design/triton_kernel.md), so the tuner chooses.

Split-KV: sequence b's keys are cut into at most `n_splits` chunks (multiples of BLOCK_N).
Splits write a normalized partial output and its log2-sum-exp; a merge combines them,
either in a second launch or (fast mode) in the last split program to finish, found with an
atomic counter that the merging program resets for the next call. On NVIDIA the second
launch may be a programmatic dependent launch (PDL): its programs start while the split
kernel drains, read their bounds, and wait for its writes at `griddepcontrol.wait`.

Balanced schedule (SCHED constexpr; the default SCHED_SPLITS is the per-sequence split
above). With ragged lengths, equal splits per sequence leave the longest sequences'
programs running after the others finish. The balanced schedules cut every sequence into
BLOCK_N-key blocks, lay the blocks of the whole batch end to end in sequence order, and
give each of the `n_splits` programs an equal run of that stream (FlashMLA's
get_mla_metadata plans the same kind of split on the host). A run may hold the end of one
sequence, whole sequences and the start of the next: the program handles them one segment
at a time. Each program computes the schedule itself from the lengths (one vector load and
a prefix sum over the batch), so there is no planning launch, nothing is read on the host,
and one compiled kernel serves every length. The partials of (program p, sequence b) go to
slot p + b: a sequence's slots are consecutive, and no two segments share one (for
b < b', sequence b' starts at or after the program where b ends), so n_splits + batch
slots hold them all. A sequence inside one program's run is written directly.
Each sequence also counts `seg_cost` blocks of setup at its start, so a program whose run
starts a sequence gets fewer keys. With CHUNKS (the `bucket_runs='chunks'` knob) no run
crosses a sequence: the programs compute the smallest chunk of c blocks for which the
sequences' chunks (ceil(blocks / c) each) number at most the programs (a binary search
over c), and program p takes chunk p of that list, cut evenly inside its sequence; its
partial goes to slot p, and programs past the last chunk exit. A segment's fixed costs
(Q load, pipeline fill and drain, partial write) are then paid once per program, as in
per-sequence splits, at the price of chunks rounded up per sequence.
SCHED_TOKENS reads the contiguous cache (KV_INDPTR: cumulative tokens); SCHED_PAGED reads
FlashInfer's paged metadata as servers hold it (KV_INDPTR: per-sequence lengths;
PAGE_TBL: page indices, PAGED == PAGE_INDEX), each tile's page indices loaded one tile
ahead: through TMA where a tile lies inside a page and pool_tma says so
(_attend_paged_tma), else through pointer loads, with one page index per tile where
paged_tiles says so (PAGED == PAGE_TILES), else one per key.

Causality: query j of a sequence with q_len queries and kv length L sees keys
[0, L - q_len + j].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FMT_BF16, FMT_FP8, FMT_MXFP4 = 0, 1, 2
CMP_BF16, CMP_FP16, CMP_FP8, CMP_FP8QK = 0, 1, 2, 3
FORMATS = {"bf16": FMT_BF16, "fp8": FMT_FP8, "mxfp4": FMT_MXFP4}
COMPUTES = {"bf16": CMP_BF16, "fp16": CMP_FP16, "fp8": CMP_FP8, "fp8qk": CMP_FP8QK}

TMA_OFF, TMA_KERNEL_DESC, TMA_HOST_DESC = 0, 1, 2
"""Values of the split kernel's TMA constexpr: pointer loads, descriptors made per program,
descriptors made on the host (see "KV loads" above)."""
SCHED_SPLITS, SCHED_TOKENS, SCHED_PAGED = 0, 1, 2
"""Values of the SCHED constexpr (see "Balanced schedule" above): per-sequence splits; the
token-balanced schedule over a contiguous cache (KV_INDPTR: cumulative tokens); the same
over FlashInfer's paged metadata (KV_INDPTR: lengths, PAGE_TBL: page indices)."""
PAGE_INDEX = 2
"""PAGED value for a page table of page indices (PAGED=True: of first page rows)."""
PAGE_TILES = 3
"""PAGED value for a page table of page indices whose pages hold whole tiles (pages of at
least BLOCK_N keys; a tile, aligned to BLOCK_N, lies in one page): pointer loads take one
page index per tile (`page_tiles`)."""
D_NOPE = tl.constexpr(512)
D_ROPE = tl.constexpr(64)
D_QK = tl.constexpr(576)
LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(448.0)
POOL_PAGES_BOUND = tl.constexpr(2**31 - 1)
POOL_ROWS_BOUND = tl.constexpr(2**31 - 1)
"""The page and row bounds of descriptors over a page pool, whose size the kernel is not
given: every page they read is one of the table's (inside the pool: checked at plan)."""
MERGE_CHUNKS = tl.constexpr(16)
"""Programs per (row block, sequence) in the second-launch merge, each on 512/16 dims."""
LAZY_TAU = tl.constexpr(8.0)
"""Lazy rescaling skips the accumulator rescale until a row max grows by more than this
(log2 units): probabilities then stay below 2**8, safe in bf16/fp16 and in e4m3."""


def _e2m1_ptx() -> str:
    """The decode's PTX (described under _E2M1_PTX), built from its repeated step: the low
    or high nibbles (`mask`, shifted by `sa` and `sb`) of two bytes spread to 16-bit lanes,
    into bf16x2 register `out`, times `scale`."""
    def nibbles(mask: str, sa: int, sb: int, out: str, scale: str) -> str:
        return (f"and.b32 x, t, {mask};\nshl.b32 a, x, {sa};\nshl.b32 b, x, {sb};\n"
                "lop3.b32 x, a, b, 0x71C071C0, 0xE4;\nmul.rn.bf16x2 x, x, k;\n"
                f"mul.rn.bf16x2 {out}, x, {scale};\n")

    lo, hi = ("0x000F000F", 6, 12), ("0x00F000F0", 2, 8)
    return ("\n{\n.reg .b32 t, x, a, b, k, z;\nmov.b32 z, 0;\nmov.b32 k, 0x7E807E80;\n"
            "prmt.b32 t, $4, z, 0x4140;\n" + nibbles(*lo, "$0", "$5") + nibbles(*hi, "$2", "$5")
            + "prmt.b32 t, $4, z, 0x4342;\n" + nibbles(*lo, "$1", "$6")
            + nibbles(*hi, "$3", "$6") + "}\n")


_E2M1_PTX = tl.constexpr(_e2m1_ptx())
"""sm_90 E2M1 decode of four packed bytes ($4) with per-element bf16 scales ($5, $6) into
the low nibbles ($0, $1) and high nibbles ($2, $3), two bf16 per register. Each pair of
bytes is spread to 16-bit lanes (prmt); a nibble's magnitude bits go to bf16 bits 6-8 and
its sign to bit 15 (and, two shifts, one lop3: (a & c) | (b & ~c)). That bf16 is the E2M1
value times 2**-126 (E2M1's subnormal 0.5 lands on bf16's subnormal range), so multiplying
by 2**126 and then by the block scale is exact: 2.25 integer and 1 bf16x2 instruction per
element."""


@triton.jit
def _decode_e2m1(packed, scale, NV_ASM: tl.constexpr):
    """E2M1 nibbles [R, NB, 16] uint8 with E8M0 scales [R, NB] -> (low, high) nibbles as
    bf16 [R, NB, 16] each: element 2i and 2i+1 of block-relative byte i.

    The values are exact (E2M1 has one mantissa bit and the scale is a power of two).
    NV_ASM uses the PTX decode above; elsewhere (AMD, the interpreter) the block scale is
    added to the exponent with integer arithmetic: both nibbles of a byte in one int32 (two
    bf16 bit patterns, element 2i in the low half)."""
    if NV_ASM:
        s = scale.to(tl.int32)
        mult = tl.where(s == 0, 0x40, s << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_PTX, "=r,=r,=r,=r,r,r,r", [packed, mult[:, :, None]],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        p = packed.to(tl.int32)
        x = (p | (p << 12)) & 0x000F000F  # low nibble in bits 0-3, high nibble in bits 16-19
        m = x & 0x00070007  # magnitudes
        nz = ((m + 0x00070007) >> 3) & 0x00010001  # per half: m >= 1
        ge2 = ((m + 0x00060006) >> 3) & 0x00010001  # per half: m >= 2 (exponent >= 1)
        # Per half: m >= 2 -> (m << 6) + ((s - 1) << 7); m == 1 (0.5) -> (s - 1) << 7;
        # 0 -> 0. = nz * ((s - 1) * 128 - 64) + ((m + ge2) << 6); exact mod 2**32 since
        # each half's result lies in [0, 0x8000) for scale bytes 1..253 (borrows between
        # halves cancel).
        e = (scale.to(tl.int32) * 128 - 192)[:, :, None]
        bits = nz * e + ((m + ge2) << 6) + ((x & 0x00080008) << 12)
        lo = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _load_mxfp4_part(KV, KV_SC, sc_stride, phys, n_ok, b0, NB: tl.constexpr,
                     NV_ASM: tl.constexpr):
    """Blocks [b0, b0 + NB) of the 18 32-dim blocks of an MXFP4 KV tile, decoded to bf16
    and split by dimension parity: (even dims, odd dims) [BLOCK_N, NB * 16]. Keeping the two
    nibbles of a byte apart (instead of interleaving them) needs no join or reshape in
    registers, and each decoded part goes to shared memory once for both products; the
    products contract over even and odd dimensions separately (Q is split the same way).
    A tile is decoded in three parts (rope, then each half of the nope dims), each consumed
    by QK^T before the next is decoded: decoded whole, a 64-key tile held about 144
    registers per thread on its way to shared memory and spilled on sm_90.

    The packed bytes are loaded as whole row segments ([BLOCK_N, NB * 16], contiguous per
    token): lanes then run along a row, shared memory is laid out dims-major, and each
    thread's decoded values go there in 16-byte stores. Loaded per 32-dim block
    ([BLOCK_N, NB, 16]) the lanes ran along tokens, the layout was token-major, and the
    values went one bf16 at a time (288 stores per thread and 64-key tile; 256x8192 on the
    H200: 728 vs 928 us)."""
    blk = tl.arange(0, NB)
    byte = tl.arange(0, NB * 16)
    pk = tl.load(KV + phys[:, None] * (D_QK // 2) + b0 * 16 + byte[None, :],
                 mask=n_ok[:, None], other=0)
    pk = tl.reshape(pk, [pk.shape[0], NB, 16])
    sc = tl.load(KV_SC + phys[:, None] * sc_stride + b0 + blk[None, :], mask=n_ok[:, None],
                 other=0)
    R: tl.constexpr = pk.shape[0]
    if sc_stride >= 0:  # always (a row stride); see below
        e, o = _decode_e2m1(pk, sc, NV_ASM)
    else:
        # Same decode. The branch only keeps the compiler from re-decoding the part in
        # each MMA operand layout (it does not rematerialize across an scf.if).
        e, o = _decode_e2m1(pk, sc, NV_ASM)
    return tl.reshape(e, [R, NB * 16]), tl.reshape(o, [R, NB * 16])


@triton.jit
def _load_q_parity(q_row, d0, D: tl.constexpr, row_ok, UPCAST: tl.constexpr):
    """Query dims [d0, d0 + D) of rows `q_row` as MMA operands split by parity (even, odd)
    [BLOCK_M, D // 2], the order _load_mxfp4_part decodes the tile in. Loaded contiguously
    and split in registers: a strided load of each parity left the operands in a
    column-major shared layout that the per-tile ldmatrix read with bank conflicts."""
    q = tl.load(q_row + d0 + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(q, [q.shape[0], D // 2, 2]))
    return _mma_operand(even, 0, UPCAST), _mma_operand(odd, 0, UPCAST)


@triton.jit
def _load_kv_tile(KV, phys, n_ok):
    """One bf16 or fp8 KV tile as stored: (nope [BLOCK_N, 512], rope [BLOCK_N, 64])."""
    row = phys[:, None] * D_QK
    kn = tl.load(KV + row + tl.arange(0, D_NOPE)[None, :], mask=n_ok[:, None], other=0.0)
    kr = tl.load(KV + row + D_NOPE + tl.arange(0, D_ROPE)[None, :], mask=n_ok[:, None],
                 other=0.0)
    return kn, kr


@triton.jit
def _mma_operand(x, COMPUTE: tl.constexpr, UPCAST: tl.constexpr):
    """Cast a tile to the compute dtype; under the interpreter go on to float32 (its bf16
    dot is broken), after the rounding the GPU path would do."""
    if COMPUTE == 0:
        x = x.to(tl.bfloat16)
    elif COMPUTE == 1:
        x = x.to(tl.float16)
    elif UPCAST and not x.dtype.is_fp8():
        x = _round_e4m3(x.to(tl.float32))
    else:
        x = x.to(tl.float8e4nv)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _round_e4m3(x):
    """float32 -> nearest e4m3 value, subnormals included, kept in float32. The
    interpreter's own fp8 cast mis-rounds values near and below 2**-6."""
    a = tl.abs(x)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)
    step = tl.exp2(e - 3.0)
    r = tl.minimum(tl.floor(a / step + 0.5) * step, FP8_MAX)
    return tl.where(x < 0, -r, r)


@triton.jit
def _merge_splits(PART_O, PART_LSE, OUT, grow, pbase, row_ok, n_act, total_rows,
                  BLOCK_M: tl.constexpr):
    """Combine `n_act` normalized partials of output rows `grow` by their log2-sum-exp, one
    partial at a time (the fused merge: a whole [BLOCK_M, 512] partial per step). Partial
    s of a row is partial row `s * total_rows + pbase` (`pbase` is `grow` for per-sequence
    splits; the balanced schedule packs a sequence's partials, see _stream_schedule)."""
    offs_d = tl.arange(0, D_NOPE)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    wsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_NOPE], tl.float32)
    s = 0
    while s < n_act:  # a while loop: the interpreter cannot range() over a loaded bound
        prow = s * total_rows + pbase
        lse = tl.load(PART_LSE + prow, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(PART_O + prow[:, None] * D_NOPE + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * o
        wsum = wsum * alpha + w
        m = m_new
        s += 1
    wsum = tl.where(wsum > 0, wsum, 1.0)
    out = acc / wsum[:, None]
    tl.store(OUT + grow[:, None] * D_NOPE + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _merge_split_blocks(PART_O, PART_LSE, OUT, grow, pbase, row_ok, n_act, total_rows, d0,
                        BLOCK_M: tl.constexpr, D_CHUNK: tl.constexpr, S_BLOCK: tl.constexpr):
    """Combine `n_act` partials of output rows `grow` (partial rows `s * total_rows +
    pbase`, as in _merge_splits), dims [d0, d0 + D_CHUNK), S_BLOCK partials per step in
    one load each of their LSEs and outputs: a merge of up to S_BLOCK splits is one round
    trip to the cache, not one per split."""
    offs_d = d0 + tl.arange(0, D_CHUNK)
    offs_s = tl.arange(0, S_BLOCK)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    wsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_CHUNK], tl.float32)
    s0 = 0
    while s0 < n_act:  # a while loop: the interpreter cannot range() over a loaded bound
        ok = ((s0 + offs_s) < n_act)[:, None] & row_ok[None, :]
        prow = (s0 + offs_s)[:, None] * total_rows + pbase[None, :]  # [S_BLOCK, BLOCK_M]
        lse = tl.load(PART_LSE + prow, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(PART_O + prow[:, :, None] * D_NOPE + offs_d[None, None, :],
                    mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[None, :])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        wsum = wsum * alpha + tl.sum(w, 0)
        m = m_new
        s0 += S_BLOCK
    wsum = tl.where(wsum > 0, wsum, 1.0)
    out = acc / wsum[:, None]
    tl.store(OUT + grow[:, None] * D_NOPE + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _split_bounds(KV_INDPTR, b, n_splits, BLOCK_N: tl.constexpr):
    """(kv_start, L, chunk, active splits) of sequence b; splits are BLOCK_N multiples."""
    kv_start = tl.load(KV_INDPTR + b)
    L = tl.load(KV_INDPTR + b + 1) - kv_start
    chunk = tl.cdiv(tl.cdiv(L, n_splits), BLOCK_N) * BLOCK_N
    n_act = tl.cdiv(L, chunk)
    return kv_start, L, chunk, n_act


@triton.jit
def _stream_schedule(KV_INDPTR, batch, n_progs, seg_cost, SCHED: tl.constexpr,
                     BLOCK_N: tl.constexpr, BATCH_P2: tl.constexpr):
    """The token-balanced schedule (see "Balanced schedule" in the module docstring) of the
    whole batch, from its lengths: per sequence [BATCH_P2] (first key row, length, first
    unit in the batch's stream, blocks) and `per`, the units of each program's run. A
    sequence takes `seg_cost` units of the stream before its blocks: the setup a program
    pays for each sequence it starts. SCHED_TOKENS: KV_INDPTR holds cumulative tokens;
    SCHED_PAGED: the lengths (keys are found through pages, so the first key row is 0)."""
    ob = tl.arange(0, BATCH_P2)
    ok = ob < batch
    if SCHED == 1:
        start = tl.load(KV_INDPTR + ob, mask=ok, other=0).to(tl.int32)
        L = tl.load(KV_INDPTR + 1 + ob, mask=ok, other=0).to(tl.int32) - start
    else:
        L = tl.load(KV_INDPTR + ob, mask=ok, other=0).to(tl.int32)
        start = tl.zeros([BATCH_P2], tl.int32)
    nblk = tl.cdiv(L, BLOCK_N)
    units = tl.where(ok, nblk + seg_cost, 0)
    blk0 = tl.cumsum(units, 0) - units
    per = tl.maximum(tl.cdiv(tl.sum(units, 0), n_progs), 1)
    return start, L, blk0, nblk, per


@triton.jit
def _seq_keys(KV_INDPTR, b, SCHED: tl.constexpr):
    """(first key row, length) of sequence b under a balanced schedule (_stream_schedule)."""
    if SCHED == 1:
        kv_start = tl.load(KV_INDPTR + b).to(tl.int32)
        L = tl.load(KV_INDPTR + b + 1).to(tl.int32) - kv_start
    else:
        L = tl.load(KV_INDPTR + b).to(tl.int32)
        kv_start = L * 0
    return kv_start, L


@triton.jit
def _pick(v, sel):
    """The element of vector `v` where `sel` holds (0 where it holds nowhere)."""
    return tl.sum(tl.where(sel, v, 0), 0)


@triton.jit
def _stream_partials(c0, n, b, per):
    """(first partial slot, number of partials) of sequence b whose blocks are units
    [c0, c0 + n) of the stream: programs c0 // per .. (c0 + n - 1) // per write its
    partials, program p to slot p + b."""
    p0 = c0 // per
    return p0 + b, (c0 + n - 1) // per - p0 + 1


@triton.jit
def _chunk_schedule(KV_INDPTR, batch, n_progs, SCHED: tl.constexpr, BLOCK_N: tl.constexpr,
                    BATCH_P2: tl.constexpr):
    """The chunked balanced schedule (CHUNKS; "Balanced schedule" in the module docstring)
    from the lengths: per sequence [BATCH_P2] (blocks, chunks, first chunk in the batch's
    list) for the smallest chunk size whose chunks number at most `n_progs`."""
    ob = tl.arange(0, BATCH_P2)
    ok = ob < batch
    if SCHED == 1:
        L = tl.load(KV_INDPTR + 1 + ob, mask=ok, other=0).to(tl.int32) - \
            tl.load(KV_INDPTR + ob, mask=ok, other=0).to(tl.int32)
    else:
        L = tl.load(KV_INDPTR + ob, mask=ok, other=0).to(tl.int32)
    nblk = tl.where(ok, tl.cdiv(L, BLOCK_N), 0)
    hi = tl.maximum(tl.max(nblk, 0), 1)
    lo = hi * 0 + 1
    while lo < hi:  # every sequence in one chunk (hi) fits: batch <= n_progs
        mid = (lo + hi) // 2
        if tl.sum(tl.cdiv(nblk, mid), 0) <= n_progs:
            hi = mid
        else:
            lo = mid + 1
    k = tl.cdiv(nblk, lo)
    return nblk, k, tl.cumsum(k, 0) - k


@triton.jit
def _seq_chunks(nblk, k, first, b, BATCH_P2: tl.constexpr):
    """(blocks, chunks actually holding blocks, first slot, blocks per chunk) of sequence
    b under _chunk_schedule: its blocks cut evenly into chunks of ceil(blocks / chunks)."""
    sel = tl.arange(0, BATCH_P2) == b
    n = _pick(nblk, sel)
    per = tl.cdiv(n, tl.maximum(_pick(k, sel), 1))
    return n, tl.cdiv(n, tl.maximum(per, 1)), _pick(first, sel), per


@triton.jit
def _tile_rows(PAGE_TBL, pg_start, page_shift, kv_start, n0, hi, BLOCK_N: tl.constexpr,
               PAGED: tl.constexpr):
    """(token offsets, in-range mask, physical cache rows) of the tile [n0, n0 + BLOCK_N).
    PAGED: table entries are the first physical row of each page (identity_page_table);
    PAGED == PAGE_INDEX: they are page indices, as servers store them; PAGE_TILES: page
    indices of pages that hold whole tiles, one index per tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    if PAGED == 3:
        page = tl.load(PAGE_TBL + pg_start + (n0 >> page_shift))
        phys = (page.to(tl.int64) << page_shift) + ((n0 & ((1 << page_shift) - 1))
                                                     + tl.arange(0, BLOCK_N))
    elif PAGED:
        ent = tl.load(PAGE_TBL + pg_start + (offs_n >> page_shift), mask=n_ok, other=0)
        if PAGED == 2:
            phys = (ent.to(tl.int64) << page_shift) + (offs_n & ((1 << page_shift) - 1))
        else:
            phys = (ent + (offs_n & ((1 << page_shift) - 1))).to(tl.int64)
    else:
        # Contiguous cache: no table load in the dependency chain of the tile load.
        phys = (kv_start + offs_n).to(tl.int64)
    return offs_n, n_ok, phys


@triton.jit
def _dims_interleaved(x):
    """The value dims (last axis, 512) of `x` reordered so that MMA row
    r = 64 i + 16 w + 8 h + g holds dim 128 w + 16 g + 2 i + h: the rows one thread owns in
    the A operand of a transposed P V (warp w, lane group g, eight 64-row blocks i, two
    halves h) are then 16 consecutive dims, one 16-byte read of each key's row. See "fp8
    P V" in the module docstring."""
    R: tl.constexpr = x.shape[0]
    x = tl.reshape(x, [R, 4, 8, 8, 2])
    x = tl.permute(x, (0, 3, 1, 4, 2))
    return tl.reshape(x, [R, D_NOPE])


@triton.jit
def _dims_natural(x):
    """The inverse of _dims_interleaved: back to natural dim order, once per program, so
    the output is stored in whole rows (stored at the interleaved dims instead, one bf16
    per store, the epilogue took 8 us of a 256x8192 program on the H200, bf16's 0.5)."""
    R: tl.constexpr = x.shape[0]
    x = tl.reshape(x, [R, 8, 4, 2, 8])
    x = tl.permute(x, (0, 2, 4, 1, 3))
    return tl.reshape(x, [R, D_NOPE])


@triton.jit
def _attend_tile(kn_raw, kr_raw, offs_n, n_ok, sc_stride, qnT, qrT, row_scale, limit, m_i,
                 l_i, acc, lazy, p_gain, KV_FMT: tl.constexpr, COMPUTE: tl.constexpr,
                 UPCAST: tl.constexpr, STAGED: tl.constexpr):
    """One bf16 or fp8 KV tile (`kn_raw` [BLOCK_N, 512], `kr_raw` [BLOCK_N, 64] as stored,
    tokens `offs_n`, `n_ok` in range) of the online softmax; returns (m_i, l_i, acc)."""
    if COMPUTE == 3:
        # e4m3 QK^T on the tile as stored; only the values are converted, to fp16.
        kn = _mma_operand(kn_raw, 2, UPCAST)
        kr = _mma_operand(kr_raw, 2, UPCAST)
        if STAGED:
            if sc_stride >= 0:  # see "staged" below
                kv = _mma_operand(kn_raw, 1, UPCAST)
            else:
                kv = _mma_operand(kn_raw, 1, UPCAST)
        else:
            kv = _mma_operand(kn_raw, 1, UPCAST)
    elif (KV_FMT == 1) and (COMPUTE != 2) and STAGED:
        # fp8 KV converted for 16-bit MMAs, "staged": converting inside a branch the
        # compiler cannot fold (a row stride is never negative) makes it convert the tile
        # once, in the layout it was loaded in, and stage the converted tile through shared
        # memory. Otherwise ("operand") it loads the tile to registers without the cp.async
        # pipeline and converts it once per MMA operand layout (sm_90 PTX: 18 vs 2
        # cp.async and 72 vs 208 conversions per thread and 32-token tile). Which is faster
        # depends on the shape, so it is a knob (`fp8_convert`).
        if sc_stride >= 0:
            kn = _mma_operand(kn_raw, COMPUTE, UPCAST)
            kr = _mma_operand(kr_raw, COMPUTE, UPCAST)
        else:
            kn = _mma_operand(kn_raw, COMPUTE, UPCAST)
            kr = _mma_operand(kr_raw, COMPUTE, UPCAST)
        kv = kn
    else:
        kn = _mma_operand(kn_raw, COMPUTE, UPCAST)
        kr = _mma_operand(kr_raw, COMPUTE, UPCAST)
        kv = kn
        if COMPUTE == 2:
            kv = _dims_interleaved(kn)
    # Transposed products (keys and value dims as the MMA's M side, query rows as N): the
    # KV tile is the A operand straight from shared memory, and a handful of query rows
    # only set N, so the accumulator stays small and Hopper can use wgmma. Below 64 keys
    # QK^T cannot be a wgmma (M >= 64) and runs on mma.sync with the query rows as M: with
    # 32 keys as M the four warps split the keys two ways and each pair of warps computed
    # the same half (bf16 256x8192 on the H200: 540 vs 581 us).
    if kn.shape[0] < 64:
        s = tl.trans(tl.dot(tl.trans(qrT), tl.trans(kr), tl.dot(tl.trans(qnT), tl.trans(kn))))
    else:
        s = tl.dot(kn, qnT)
        s = tl.dot(kr, qrT, s)
    s = s * row_scale[None, :]
    valid = n_ok[:, None] & (offs_n[:, None] <= limit[None, :])
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    # Lazy rescaling: skip the accumulator rescale while no row max grew by > LAZY_TAU.
    if (lazy == 0) | (tl.max(m_new - m_i, 0) > LAZY_TAU):
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[None, :]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(s - m_i[None, :])
    l_i += tl.sum(p, 0)
    if COMPUTE == 2:
        p = p * p_gain
    acc = tl.dot(tl.trans(kv), _mma_operand(p, 1 if COMPUTE == 3 else COMPUTE, UPCAST), acc)
    return m_i, l_i, acc


@triton.jit
def _attend_kv_tile(KV, desc_n, desc_r, PAGE_TBL, pg_start, page_shift, kv_start, n0, hi,
                    sc_stride, qnT, qrT, row_scale, limit, m_i, l_i, acc, lazy, p_gain,
                    KV_FMT: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGED: tl.constexpr, UPCAST: tl.constexpr, STAGED: tl.constexpr,
                    TMA: tl.constexpr):
    """_attend_tile on the tile [n0, n0 + BLOCK_N), loaded through TMA descriptors (TMA
    nonzero: contiguous cache) or through pointers (masked at `hi`; `desc_n`/`desc_r` are
    unused)."""
    if TMA != 0:
        row0 = (kv_start + n0).to(tl.int32)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kn_raw = desc_n.load([row0, 0])
        kr_raw = desc_r.load([row0, D_NOPE])
    else:
        offs_n, n_ok, phys = _tile_rows(PAGE_TBL, pg_start, page_shift, kv_start, n0, hi,
                                        BLOCK_N, PAGED)
        kn_raw, kr_raw = _load_kv_tile(KV, phys, n_ok)
    return _attend_tile(kn_raw, kr_raw, offs_n, n_ok, sc_stride, qnT, qrT, row_scale, limit,
                        m_i, l_i, acc, lazy, p_gain, KV_FMT, COMPUTE, UPCAST, STAGED)


@triton.jit
def _paged_ptr_tile(KV, PAGE_TBL, pg_start, page_shift, ent, n0, hi, sc_stride, qnT, qrT,
                    row_scale, limit, m_i, l_i, acc, lazy, p_gain, KV_FMT: tl.constexpr,
                    COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                    STAGED: tl.constexpr, TILES: tl.constexpr):
    """A tile [n0, n0 + BLOCK_N) of a paged sequence through masked pointer loads; `ent`
    (its keys' page indices; TILES: the tile's one page index, pages holding whole tiles)
    was loaded one tile ahead, so the table load is not in the dependency chain of the
    tile's load. Returns (m_i, l_i, acc, the next tile's page index or indices)."""
    offs = tl.arange(0, BLOCK_N)
    if TILES:
        # One index and an affine row range per tile: the rows' addresses compile as the
        # contiguous cache's do, not as 64-bit arithmetic on a table entry per row.
        nn = n0 + BLOCK_N
        nxt = tl.load(PAGE_TBL + pg_start + (nn >> page_shift), mask=nn < hi, other=0)
        offs_n = n0 + offs
        n_ok = offs_n < hi
        phys = (ent.to(tl.int64) << page_shift) + ((n0 & ((1 << page_shift) - 1)) + offs)
    else:
        nn = n0 + BLOCK_N + offs
        nxt = tl.load(PAGE_TBL + pg_start + (nn >> page_shift), mask=nn < hi, other=0)
        offs_n = n0 + offs
        n_ok = offs_n < hi
        phys = (ent.to(tl.int64) << page_shift) + (offs_n & ((1 << page_shift) - 1))
    kn_raw, kr_raw = _load_kv_tile(KV, phys, n_ok)
    m_i, l_i, acc = _attend_tile(kn_raw, kr_raw, offs_n, n_ok, sc_stride, qnT, qrT, row_scale,
                                 limit, m_i, l_i, acc, lazy, p_gain, KV_FMT, COMPUTE, UPCAST,
                                 STAGED)
    return m_i, l_i, acc, nxt


@triton.jit
def _attend_paged(KV, PAGE_TBL, pg_start, page_shift, lo, hi, sc_stride, qnT, qrT, row_scale,
                  limit, m_i, l_i, acc, lazy, p_gain, KV_FMT: tl.constexpr,
                  COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                  STAGED: tl.constexpr, TILES: tl.constexpr):
    """Keys [lo, hi) of a bf16/fp8 sequence whose pages PAGE_TBL lists by index (PAGED ==
    PAGE_INDEX, or PAGE_TILES: TILES), through masked pointer loads, each tile's page
    indices (TILES: its page index) loaded one tile ahead. (Whole tiles through TMA over
    the pool's rows, for pages of a tile or more, was no faster on the H200: 5-10 % slower
    at 32 sequences, 1-2 % faster at 128; bench/results/serving_loop.md.)"""
    if TILES:
        ent = tl.load(PAGE_TBL + pg_start + (lo >> page_shift), mask=lo < hi, other=0)
    else:
        offs = tl.arange(0, BLOCK_N)
        ent = tl.load(PAGE_TBL + pg_start + ((lo + offs) >> page_shift), mask=lo + offs < hi,
                      other=0)
    if UPCAST:
        n0 = lo
        while n0 < hi:  # the interpreter cannot range() over loaded bounds
            m_i, l_i, acc, ent = _paged_ptr_tile(
                KV, PAGE_TBL, pg_start, page_shift, ent, n0, hi, sc_stride, qnT, qrT,
                row_scale, limit, m_i, l_i, acc, lazy, p_gain, KV_FMT, COMPUTE, BLOCK_N,
                UPCAST, STAGED, TILES)
            n0 += BLOCK_N
    else:
        for n0 in range(lo, hi, BLOCK_N):
            m_i, l_i, acc, ent = _paged_ptr_tile(
                KV, PAGE_TBL, pg_start, page_shift, ent, n0, hi, sc_stride, qnT, qrT,
                row_scale, limit, m_i, l_i, acc, lazy, p_gain, KV_FMT, COMPUTE, BLOCK_N,
                UPCAST, STAGED, TILES)
    return m_i, l_i, acc


@triton.jit
def _paged_tma_tile(desc_n, desc_r, PAGE_TBL, pg_start, page, n0, hi, page_shift, sc_stride,
                    qnT, qrT, row_scale, limit, m_i, l_i, acc, lazy, p_gain,
                    KV_FMT: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr,
                    UPCAST: tl.constexpr, STAGED: tl.constexpr):
    """The tile of keys [n0, min(n0 + BLOCK_N, hi)) of a paged sequence, in page `page`
    (its page index, loaded one tile ahead so the table load is not in the dependency
    chain of the tile's load), through TMA over the pool as (pages, page rows, 576). A
    partial last tile is loaded as the box ending at its last key: the box's first rows
    are then earlier keys of the page (masked) or, before the page's first row, outside
    the descriptor (zeros), never the rows past the sequence's end, which may hold
    anything (NaN included). Returns (m_i, l_i, acc, the next tile's page index)."""
    nn = n0 + BLOCK_N
    nxt = tl.load(PAGE_TBL + pg_start + (nn >> page_shift), mask=nn < hi, other=0)
    shift = tl.maximum(n0 + BLOCK_N - hi, 0)
    r = (n0 & ((1 << page_shift) - 1)) - shift
    kn = desc_n.load([page, r, 0]).reshape([BLOCK_N, D_NOPE])
    kr = desc_r.load([page, r, D_NOPE]).reshape([BLOCK_N, D_ROPE])
    i = tl.arange(0, BLOCK_N)
    m_i, l_i, acc = _attend_tile(kn, kr, n0 - shift + i, i >= shift, sc_stride, qnT, qrT,
                                 row_scale, limit, m_i, l_i, acc, lazy, p_gain, KV_FMT,
                                 COMPUTE, UPCAST, STAGED)
    return m_i, l_i, acc, nxt


@triton.jit
def _pool_rows_tile(desc_n, desc_r, PAGE_TBL, pg_start, page, n0, hi, page_shift, sc_stride,
                    qnT, qrT, row_scale, limit, m_i, l_i, acc, lazy, p_gain,
                    KV_FMT: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr,
                    UPCAST: tl.constexpr, STAGED: tl.constexpr):
    """The whole tile of keys [n0, n0 + BLOCK_N) of a paged sequence, in page `page` (its
    page index, loaded one tile ahead), through TMA over the pool's rows (pages x page
    rows, 576): a whole tile is consecutive rows of one page, so it loads as the
    contiguous cache's tiles do, and QK^T reads K from shared memory. Returns (m_i, l_i,
    acc, the next tile's page index)."""
    nn = n0 + BLOCK_N
    nxt = tl.load(PAGE_TBL + pg_start + (nn >> page_shift), mask=nn < hi, other=0)
    row = (page << page_shift) + (n0 & ((1 << page_shift) - 1))
    kn = desc_n.load([row, 0])
    kr = desc_r.load([row, D_NOPE])
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_i, l_i, acc = _attend_tile(kn, kr, offs_n, offs_n < hi, sc_stride, qnT, qrT, row_scale,
                                 limit, m_i, l_i, acc, lazy, p_gain, KV_FMT, COMPUTE, UPCAST,
                                 STAGED)
    return m_i, l_i, acc, nxt


@triton.jit
def _pool_box_descriptors(KV, P, BLOCK_N: tl.constexpr):
    """Descriptors of the nope and rope columns over a pool of P-key pages (pages, page
    rows, 576), one box per tile (_paged_tma_tile)."""
    desc_n = tl.make_tensor_descriptor(KV, [POOL_PAGES_BOUND, P, D_QK], [P * D_QK, D_QK, 1],
                                       [1, BLOCK_N, D_NOPE])
    desc_r = tl.make_tensor_descriptor(KV, [POOL_PAGES_BOUND, P, D_QK], [P * D_QK, D_QK, 1],
                                       [1, BLOCK_N, D_ROPE])
    return desc_n, desc_r


@triton.jit
def _attend_paged_tma(KV, PAGE_TBL, pg_start, page_shift, lo, hi, sc_stride, qnT, qrT,
                      row_scale, limit, m_i, l_i, acc, lazy, p_gain, KV_FMT: tl.constexpr,
                      COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                      STAGED: tl.constexpr):
    """Keys [lo, hi) of a bf16/fp8 sequence whose pages PAGE_TBL lists by index, pages of
    at least BLOCK_N keys (a tile, aligned to BLOCK_N, lies in one page; pool_tma), one
    page index per tile. Tiles below 64 keys, whose MMAs take their operands from
    registers either way, all come as boxes of a 3-D descriptor over (pages, page rows,
    576) (_paged_tma_tile). From 64 keys, QK^T reads K from shared memory, which the 3-D
    box's reshape prevents (57 spill instructions in the tile loop on sm_90): whole tiles
    come through a 2-D descriptor over the pool's rows (_pool_rows_tile) and a partial
    last tile, first, as the 3-D box stopping at the sequence's end (fp8 only: pool_tma).
    (The 2-D loop for 32-key tiles spilled in the loop and ran 2-12 % slower on the
    H200.)"""
    P = 1 << page_shift
    if BLOCK_N < 64:
        desc_n, desc_r = _pool_box_descriptors(KV, P, BLOCK_N)
        page = tl.load(PAGE_TBL + pg_start + (lo >> page_shift))
        if UPCAST:
            n0 = lo
            while n0 < hi:  # the interpreter cannot range() over loaded bounds
                m_i, l_i, acc, page = _paged_tma_tile(
                    desc_n, desc_r, PAGE_TBL, pg_start, page, n0, hi, page_shift,
                    sc_stride, qnT, qrT, row_scale, limit, m_i, l_i, acc, lazy, p_gain,
                    KV_FMT, COMPUTE, BLOCK_N, UPCAST, STAGED)
                n0 += BLOCK_N
        else:
            for n0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc, page = _paged_tma_tile(
                    desc_n, desc_r, PAGE_TBL, pg_start, page, n0, hi, page_shift,
                    sc_stride, qnT, qrT, row_scale, limit, m_i, l_i, acc, lazy, p_gain,
                    KV_FMT, COMPUTE, BLOCK_N, UPCAST, STAGED)
    else:
        full = lo + (hi - lo) // BLOCK_N * BLOCK_N
        if full < hi:
            # The partial tile first (the online softmax takes tiles in any order), so the
            # tile loop is the program's last: nothing of the tail lives across it (the
            # tail after the loop left 78 spill instructions in it, 23 this way).
            tail_n, tail_r = _pool_box_descriptors(KV, P, BLOCK_N)
            m_i, l_i, acc, _ = _paged_tma_tile(
                tail_n, tail_r, PAGE_TBL, pg_start,
                tl.load(PAGE_TBL + pg_start + (full >> page_shift)), full, hi, page_shift,
                sc_stride, qnT, qrT, row_scale, limit, m_i, l_i, acc, lazy, p_gain, KV_FMT,
                COMPUTE, BLOCK_N, UPCAST, STAGED)
        desc_n = tl.make_tensor_descriptor(KV, [POOL_ROWS_BOUND, D_QK], [D_QK, 1],
                                           [BLOCK_N, D_NOPE])
        desc_r = tl.make_tensor_descriptor(KV, [POOL_ROWS_BOUND, D_QK], [D_QK, 1],
                                           [BLOCK_N, D_ROPE])
        page = tl.load(PAGE_TBL + pg_start + (lo >> page_shift))
        if UPCAST:
            n0 = lo
            while n0 < full:  # the interpreter cannot range() over loaded bounds
                m_i, l_i, acc, page = _pool_rows_tile(
                    desc_n, desc_r, PAGE_TBL, pg_start, page, n0, full, page_shift,
                    sc_stride, qnT, qrT, row_scale, limit, m_i, l_i, acc, lazy, p_gain,
                    KV_FMT, COMPUTE, BLOCK_N, UPCAST, STAGED)
                n0 += BLOCK_N
        else:
            for n0 in range(lo, full, BLOCK_N):
                m_i, l_i, acc, page = _pool_rows_tile(
                    desc_n, desc_r, PAGE_TBL, pg_start, page, n0, full, page_shift,
                    sc_stride, qnT, qrT, row_scale, limit, m_i, l_i, acc, lazy, p_gain,
                    KV_FMT, COMPUTE, BLOCK_N, UPCAST, STAGED)
    return m_i, l_i, acc


@triton.jit
def _attend_tile_mxfp4(KV, KV_SC, sc_stride, PAGE_TBL, pg_start, page_shift, kv_start, n0,
                       hi, qea, qoa, qeb, qob, qre, qro, row_scale, limit, m_i, l_i, acc_ea,
                       acc_oa, acc_eb, acc_ob, lazy,
                       BLOCK_N: tl.constexpr, PAGED: tl.constexpr, UPCAST: tl.constexpr,
                       NV_ASM: tl.constexpr):
    """One MXFP4 KV tile of the online softmax over even and odd dimensions apart (see
    _load_mxfp4_part); `qea`/`qoa` and `qeb`/`qob` ([BLOCK_M, 128]) are the query rows' even
    and odd dims of the first and second half of the 512 nope dims, `qre`/`qro`
    ([BLOCK_M, 32]) of the rope dims, and `acc_ea` ... `acc_ob` the output's in the same
    split. Returns (m_i, l_i, acc_ea, acc_oa, acc_eb, acc_ob).

    Query rows are the M side of both products and the decoded tile is the B operand of
    both (transposed for QK^T), so the tile is written to shared memory once, in the layout
    it was decoded in, and read from there by both. (Decoding it per MMA operand instead,
    with keys as M, holds the decoded A operands in registers: 40-776 bytes of spills on
    sm_90 at 32-64 keys.)"""
    offs_n, n_ok, phys = _tile_rows(PAGE_TBL, pg_start, page_shift, kv_start, n0, hi,
                                    BLOCK_N, PAGED)
    kre, kro = _load_mxfp4_part(KV, KV_SC, sc_stride, phys, n_ok, D_NOPE // 32, D_ROPE // 32,
                                NV_ASM)
    kre = _mma_operand(kre, 0, UPCAST)
    kro = _mma_operand(kro, 0, UPCAST)
    s = tl.dot(qre, tl.trans(kre))
    s = tl.dot(qro, tl.trans(kro), s)
    kea, koa = _load_mxfp4_part(KV, KV_SC, sc_stride, phys, n_ok, 0, D_NOPE // 64, NV_ASM)
    kea = _mma_operand(kea, 0, UPCAST)
    koa = _mma_operand(koa, 0, UPCAST)
    s = tl.dot(qea, tl.trans(kea), s)
    s = tl.dot(qoa, tl.trans(koa), s)
    keb, kob = _load_mxfp4_part(KV, KV_SC, sc_stride, phys, n_ok, D_NOPE // 64, D_NOPE // 64,
                                NV_ASM)
    keb = _mma_operand(keb, 0, UPCAST)
    kob = _mma_operand(kob, 0, UPCAST)
    s = tl.dot(qeb, tl.trans(keb), s)
    s = tl.dot(qob, tl.trans(kob), s)
    s = s * row_scale[:, None]
    valid = n_ok[None, :] & (offs_n[None, :] <= limit[:, None])
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Lazy rescaling: skip the accumulator rescale while no row max grew by > LAZY_TAU.
    if (lazy == 0) | (tl.max(m_new - m_i, 0) > LAZY_TAU):
        alpha = tl.exp2(m_i - m_new)
        acc_ea = acc_ea * alpha[:, None]
        acc_oa = acc_oa * alpha[:, None]
        acc_eb = acc_eb * alpha[:, None]
        acc_ob = acc_ob * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    l_i += tl.sum(p, 1)
    pb = _mma_operand(p, 0, UPCAST)
    acc_ea = tl.dot(pb, kea, acc_ea)
    acc_oa = tl.dot(pb, koa, acc_oa)
    acc_eb = tl.dot(pb, keb, acc_eb)
    acc_ob = tl.dot(pb, kob, acc_ob)
    return m_i, l_i, acc_ea, acc_oa, acc_eb, acc_ob


@triton.jit
def _attend_rows(
    Q, KV, KV_DESC_N, KV_DESC_R, KV_SCALE, KV_SC, sc_stride, PAGE_TBL, PAGE_INDPTR, page_shift,
    OUT, PART_O, PART_LSE, COUNTERS, H, total_rows, qk_scale, fast,
    pid_m, b, q_start, q_len, rows, r0, kv_start, L, split, chunk, n_act,
    seg_lo, seg_hi, slot, first,
    KV_FMT: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, UPCAST: tl.constexpr, FP8_STAGED: tl.constexpr, NV_ASM: tl.constexpr,
    TMA: tl.constexpr, SCHED: tl.constexpr,
):
    """Rows [r0, r0 + BLOCK_M) of sequence b against one range of its keys, written as the
    output (`n_act` == 1) or as a partial (merged by the last program to finish when
    `fast`). SCHED_SPLITS: keys [split * chunk, + chunk), partial `split`; otherwise keys
    [seg_lo, seg_hi), partial slot `slot`, the sequence's partials from slot `first`."""
    offs_m = r0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    grow = (q_start * H + offs_m).to(tl.int64)
    offs_d = tl.arange(0, D_NOPE)
    offs_r = tl.arange(0, D_ROPE)
    # Causal limit per row (inclusive) and the key range this program must visit.
    limit = L - q_len + offs_m // H
    j_max = tl.minimum((r0 + BLOCK_M - 1) // H, q_len - 1)
    lo = split * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, L), L - q_len + j_max + 1)
    if SCHED != 0:
        lo = seg_lo
        hi = tl.minimum(tl.minimum(seg_hi, L), L - q_len + j_max + 1)
    pg_start = 0
    if PAGED:
        pg_start = tl.load(PAGE_INDPTR + b)
    # Per-row factor taking raw dot products to log2-domain logits.
    row_scale = tl.full([BLOCK_M], qk_scale, tl.float32)
    out_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    q_row = Q + grow[:, None] * D_QK
    if KV_FMT == 2:
        qea, qoa = _load_q_parity(q_row, 0, D_NOPE // 2, row_ok, UPCAST)
        qeb, qob = _load_q_parity(q_row, D_NOPE // 2, D_NOPE // 2, row_ok, UPCAST)
        qre, qro = _load_q_parity(q_row, D_NOPE, D_ROPE, row_ok, UPCAST)
        acc_ea = tl.zeros([BLOCK_M, D_NOPE // 4], tl.float32)
        acc_oa = tl.zeros([BLOCK_M, D_NOPE // 4], tl.float32)
        acc_eb = tl.zeros([BLOCK_M, D_NOPE // 4], tl.float32)
        acc_ob = tl.zeros([BLOCK_M, D_NOPE // 4], tl.float32)
        if UPCAST:
            # The interpreter cannot take loaded scalars as range() bounds (numpy >= 2).
            n0 = lo
            while n0 < hi:
                m_i, l_i, acc_ea, acc_oa, acc_eb, acc_ob = _attend_tile_mxfp4(
                    KV, KV_SC, sc_stride, PAGE_TBL, pg_start, page_shift, kv_start, n0,
                    hi, qea, qoa, qeb, qob, qre, qro, row_scale, limit, m_i, l_i, acc_ea,
                    acc_oa, acc_eb, acc_ob, fast, BLOCK_N, PAGED, UPCAST, NV_ASM)
                n0 += BLOCK_N
        else:
            for n0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc_ea, acc_oa, acc_eb, acc_ob = _attend_tile_mxfp4(
                    KV, KV_SC, sc_stride, PAGE_TBL, pg_start, page_shift, kv_start, n0,
                    hi, qea, qoa, qeb, qob, qre, qro, row_scale, limit, m_i, l_i, acc_ea,
                    acc_oa, acc_eb, acc_ob, fast, BLOCK_N, PAGED, UPCAST, NV_ASM)
        # Back to natural dimension order: d = 256 * half + 2 * i + parity.
        acc_a = tl.reshape(tl.join(acc_ea, acc_oa), [BLOCK_M, D_NOPE // 2])
        acc_b = tl.reshape(tl.join(acc_eb, acc_ob), [BLOCK_M, D_NOPE // 2])
        acc = tl.reshape(tl.permute(tl.join(acc_a, acc_b), (0, 2, 1)), [BLOCK_M, D_NOPE])
    else:
        qn = tl.load(q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        qr = tl.load(q_row + D_NOPE + offs_r[None, :], mask=row_ok[:, None], other=0.0)
        if KV_FMT == 1:
            kv_scale = tl.load(KV_SCALE)
            row_scale = row_scale * kv_scale
            out_scale = out_scale * kv_scale
        if COMPUTE >= 2:
            amax = tl.maximum(tl.max(tl.abs(qn.to(tl.float32)), 1),
                              tl.max(tl.abs(qr.to(tl.float32)), 1))
            q_sc = tl.maximum(amax, 1e-12) / FP8_MAX
            qn = qn.to(tl.float32) / q_sc[:, None]
            qr = qr.to(tl.float32) / q_sc[:, None]
            row_scale = row_scale * q_sc
        qnT = tl.trans(_mma_operand(qn, COMPUTE, UPCAST))
        qrT = tl.trans(_mma_operand(qr, COMPUTE, UPCAST))
        # fp8 P: p <= 1 (<= 2**LAZY_TAU when lazy); a power-of-two gain uses e4m3's range.
        p_gain = tl.where(fast != 0, 1.0, 256.0)
        if COMPUTE == 2:
            out_scale = out_scale / p_gain
        acc = tl.zeros([D_NOPE, BLOCK_M], tl.float32)
        desc_n = KV
        desc_r = KV
        if (TMA == 1) and (PAGED < 2):  # (paged: _attend_paged_tma makes its own)
            # Bounded at the split's end: see "KV loads" in the module docstring.
            end = (kv_start + hi).to(tl.int32)
            desc_n = tl.make_tensor_descriptor(KV, [end, D_QK], [D_QK, 1],
                                               [BLOCK_N, D_NOPE])
            desc_r = tl.make_tensor_descriptor(KV, [end, D_QK], [D_QK, 1],
                                               [BLOCK_N, D_ROPE])
        elif TMA == 2:
            desc_n = KV_DESC_N
            desc_r = KV_DESC_R
        if (PAGED == 2) and (TMA != 0):
            m_i, l_i, acc = _attend_paged_tma(
                KV, PAGE_TBL, pg_start, page_shift, lo, hi, sc_stride, qnT, qrT, row_scale,
                limit, m_i, l_i, acc, fast, p_gain, KV_FMT, COMPUTE, BLOCK_N, UPCAST,
                FP8_STAGED)
        elif PAGED >= 2:
            m_i, l_i, acc = _attend_paged(
                KV, PAGE_TBL, pg_start, page_shift, lo, hi, sc_stride, qnT, qrT, row_scale,
                limit, m_i, l_i, acc, fast, p_gain, KV_FMT, COMPUTE, BLOCK_N, UPCAST,
                FP8_STAGED, PAGED == 3)
        elif UPCAST:
            n0 = lo
            while n0 < hi:
                m_i, l_i, acc = _attend_kv_tile(
                    KV, desc_n, desc_r, PAGE_TBL, pg_start, page_shift, kv_start, n0, hi,
                    sc_stride, qnT, qrT, row_scale, limit, m_i, l_i, acc, fast, p_gain,
                    KV_FMT, COMPUTE, BLOCK_N, PAGED, UPCAST, FP8_STAGED, TMA)
                n0 += BLOCK_N
        else:
            for n0 in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _attend_kv_tile(
                    KV, desc_n, desc_r, PAGE_TBL, pg_start, page_shift, kv_start, n0, hi,
                    sc_stride, qnT, qrT, row_scale, limit, m_i, l_i, acc, fast, p_gain,
                    KV_FMT, COMPUTE, BLOCK_N, PAGED, UPCAST, FP8_STAGED, TMA)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    if KV_FMT == 2:
        o = acc * (out_scale / l_safe)[:, None]
    else:
        o = tl.trans(acc * (out_scale / l_safe)[None, :])
    if COMPUTE == 2:
        o = _dims_natural(o)
    if n_act == 1:
        tl.store(OUT + grow[:, None] * D_NOPE + offs_d[None, :],
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    else:
        prow = split * total_rows + grow
        if SCHED != 0:
            prow = (slot * total_rows + offs_m).to(tl.int64)
        tl.store(PART_O + prow[:, None] * D_NOPE + offs_d[None, :], o,
                 mask=row_ok[:, None])
        tl.store(PART_LSE + prow, m_i + tl.log2(l_i), mask=row_ok)
        fused = fast != 0
        if SCHED != 0:
            fused = fast == 1  # 2: lazy rescaling, the merge in a second launch
        if fused:
            tl.debug_barrier()
            cidx = b * tl.num_programs(0) + pid_m
            done = tl.atomic_add(COUNTERS + cidx, 1, sem="acq_rel", scope="gpu")
            if done == n_act - 1:
                pbase = grow
                if SCHED != 0:
                    pbase = (first * total_rows + offs_m).to(tl.int64)
                # (Two partials per round trip instead held enough registers to spill in
                # the tile loop on sm_90.)
                _merge_splits(PART_O, PART_LSE, OUT, grow, pbase, row_ok, n_act, total_rows,
                              BLOCK_M)
                tl.atomic_xchg(COUNTERS + cidx, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["sc_stride", "page_shift", "total_rows", "n_splits", "fast",
                               "batch", "seg_cost"])
def mla_decode_kernel(
    Q, KV, KV_DESC_N, KV_DESC_R, KV_SCALE, KV_SC, sc_stride,
    QO_INDPTR, KV_INDPTR, PAGE_TBL, PAGE_INDPTR, page_shift,
    OUT, PART_O, PART_LSE, COUNTERS,
    H, total_rows, n_splits, qk_scale, fast,
    KV_FMT: tl.constexpr, COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, UPCAST: tl.constexpr,
    FP8_STAGED: tl.constexpr, NV_ASM: tl.constexpr, TMA: tl.constexpr,
    SCHED: tl.constexpr = 0, BATCH_P2: tl.constexpr = 1, batch=None, seg_cost=None,
    CHUNKS: tl.constexpr = 0,
):
    """Grid (row blocks, splits, batch) for SCHED_SPLITS; (row blocks, programs, 1) for the
    balanced schedules, where `n_splits` is the number of programs, `total_rows` the
    partial slots' row stride (rows of a sequence), `batch` the batch, BATCH_P2 a power of
    two >= it and `seg_cost` the blocks a sequence's setup counts for (_stream_schedule;
    CHUNKS: the chunked schedule instead, _chunk_schedule, which charges none).
    See the module docstring for the scheme.
    `fast` (runtime, so it costs no extra compile): lazy rescaling and the fused
    last-program merge instead of a second launch (balanced schedules: 2 is lazy
    rescaling with the second-launch merge). KV_DESC_N/KV_DESC_R: the host-made
    descriptors of the nope and rope columns when TMA is TMA_HOST_DESC (otherwise unused)."""
    if NV_ASM:
        # Lets a PDL merge launch start as soon as every split program has begun.
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    if SCHED == 0:
        b = tl.program_id(2)
        q_start = tl.load(QO_INDPTR + b)
        q_len = tl.load(QO_INDPTR + b + 1) - q_start
        rows = q_len * H
        r0 = pid_m * BLOCK_M
        kv_start, L, chunk, n_act = _split_bounds(KV_INDPTR, b, n_splits, BLOCK_N)
        if (r0 < rows) & (split < n_act):
            _attend_rows(
                Q, KV, KV_DESC_N, KV_DESC_R, KV_SCALE, KV_SC, sc_stride, PAGE_TBL, PAGE_INDPTR,
                page_shift, OUT, PART_O, PART_LSE, COUNTERS, H, total_rows, qk_scale, fast,
                pid_m, b, q_start, q_len, rows, r0, kv_start, L, split, chunk, n_act,
                0, 0, 0, 0, KV_FMT, COMPUTE, BLOCK_M, BLOCK_N, PAGED, UPCAST, FP8_STAGED,
                NV_ASM, TMA, SCHED)
    elif CHUNKS:
        # One chunk of one sequence: chunk `split` of the batch's list.
        r0 = pid_m * BLOCK_M
        nblk_v, k_v, first_v = _chunk_schedule(KV_INDPTR, batch, n_splits, SCHED, BLOCK_N,
                                               BATCH_P2)
        b = tl.sum(((tl.arange(0, BATCH_P2) < batch) & (first_v + k_v <= split))
                   .to(tl.int32), 0)
        if b < batch:
            n, n_act, first, per = _seq_chunks(nblk_v, k_v, first_v, b, BATCH_P2)
            j = split - first
            kv_start, L = _seq_keys(KV_INDPTR, b, SCHED)
            q_start = tl.load(QO_INDPTR + b)
            q_len = tl.load(QO_INDPTR + b + 1) - q_start
            rows = q_len * H
            if (r0 < rows) & (j < n_act):
                _attend_rows(
                    Q, KV, KV_DESC_N, KV_DESC_R, KV_SCALE, KV_SC, sc_stride, PAGE_TBL,
                    PAGE_INDPTR, page_shift, OUT, PART_O, PART_LSE, COUNTERS, H, total_rows,
                    qk_scale, fast, pid_m, b, q_start, q_len, rows, r0, kv_start, L, 0, 0,
                    n_act, j * per * BLOCK_N, tl.minimum(j * per + per, n) * BLOCK_N, split,
                    first, KV_FMT, COMPUTE, BLOCK_M, BLOCK_N, PAGED, UPCAST, FP8_STAGED,
                    NV_ASM, TMA, SCHED)
    else:
        # This program's run of the block stream: one segment per sequence it touches.
        r0 = pid_m * BLOCK_M
        _, _, blk0_v, nblk_v, per = _stream_schedule(KV_INDPTR, batch, n_splits, seg_cost,
                                                     SCHED, BLOCK_N, BATCH_P2)
        ob = tl.arange(0, BATCH_P2)
        s_lo = split * per
        s_hi = s_lo + per
        ok = ob < batch
        # Sequences whose blocks (after their setup units) meet this run.
        b = tl.sum((ok & (blk0_v + seg_cost + nblk_v <= s_lo)).to(tl.int32), 0)
        b_end = tl.sum((ok & (blk0_v + seg_cost < s_hi)).to(tl.int32), 0)
        # Only scalars live through the segments (the vectors would hold registers the
        # tile loop needs): each sequence's bounds are loaded again, the stream position
        # of its first block is carried.
        c0 = _pick(blk0_v, ob == b) + seg_cost
        while b < b_end:
            kv_start, L = _seq_keys(KV_INDPTR, b, SCHED)
            n = tl.cdiv(L, BLOCK_N)
            first, n_act = _stream_partials(c0, n, b, per)
            q_start = tl.load(QO_INDPTR + b)
            q_len = tl.load(QO_INDPTR + b + 1) - q_start
            rows = q_len * H
            if (r0 < rows) & (n > 0):
                _attend_rows(
                    Q, KV, KV_DESC_N, KV_DESC_R, KV_SCALE, KV_SC, sc_stride, PAGE_TBL,
                    PAGE_INDPTR, page_shift, OUT, PART_O, PART_LSE, COUNTERS, H, total_rows,
                    qk_scale, fast, pid_m, b, q_start, q_len, rows, r0, kv_start, L, 0, 0,
                    n_act, (tl.maximum(s_lo, c0) - c0) * BLOCK_N,
                    (tl.minimum(s_hi, c0 + n) - c0) * BLOCK_N, split + b, first, KV_FMT,
                    COMPUTE, BLOCK_M, BLOCK_N, PAGED, UPCAST, FP8_STAGED, NV_ASM, TMA, SCHED)
            c0 += n + seg_cost
            b += 1


@triton.jit(do_not_specialize=["total_rows", "n_splits", "batch", "seg_cost"])
def mla_merge_kernel(QO_INDPTR, KV_INDPTR, PART_O, PART_LSE, OUT, H, total_rows, n_splits,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                     SCHED: tl.constexpr = 0, BATCH_P2: tl.constexpr = 1, batch=None,
                     seg_cost=None, CHUNKS: tl.constexpr = 0):
    """Second-launch merge, grid (row blocks, batch, MERGE_CHUNKS): each program merges one
    slice of the output dims, 16 splits per load, so a sequence's partials are read by
    MERGE_CHUNKS programs at once in one or a few round trips. Sequences with one split
    were written directly by the split kernel. PDL: launched as a programmatic dependent
    launch, so the split kernel's writes are waited for here, after the bounds are read
    (the index arrays are inputs of both kernels, not written by either). The balanced
    schedules (SCHED, `batch`, BATCH_P2, `seg_cost`, CHUNKS and the arguments as in
    mla_decode_kernel) find a sequence's partials from the same schedule."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    d0 = tl.program_id(2) * (D_NOPE // MERGE_CHUNKS)
    q_start = tl.load(QO_INDPTR + b)
    rows = (tl.load(QO_INDPTR + b + 1) - q_start) * H
    if SCHED == 0:
        _, _, _, n_act = _split_bounds(KV_INDPTR, b, n_splits, BLOCK_N)
        first = 0
    elif CHUNKS:
        nblk_v, k_v, first_v = _chunk_schedule(KV_INDPTR, batch, n_splits, SCHED, BLOCK_N,
                                               BATCH_P2)
        _, n_act, first, _ = _seq_chunks(nblk_v, k_v, first_v, b, BATCH_P2)
    else:
        _, _, blk0_v, nblk_v, per = _stream_schedule(KV_INDPTR, batch, n_splits, seg_cost,
                                                     SCHED, BLOCK_N, BATCH_P2)
        sel = tl.arange(0, BATCH_P2) == b
        first, n_act = _stream_partials(_pick(blk0_v, sel) + seg_cost, _pick(nblk_v, sel),
                                        b, per)
    r0 = pid_m * BLOCK_M
    if PDL:
        gdc_wait()
    if (r0 < rows) & (n_act > 1):
        offs_m = r0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < rows
        grow = (q_start * H + offs_m).to(tl.int64)
        pbase = grow
        if SCHED != 0:
            pbase = (first * total_rows + offs_m).to(tl.int64)
        _merge_split_blocks(PART_O, PART_LSE, OUT, grow, pbase, row_ok, n_act, total_rows, d0,
                            BLOCK_M, D_NOPE // MERGE_CHUNKS, 16)


@dataclass(frozen=True)
class KernelConfig:
    """Compile-time and launch knobs of one variant (see configs/backends/triton.toml)."""

    kv_format: str = "bf16"
    compute: str = "bf16"
    block_m: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 0
    page_size: int = 1
    fast_mode: bool = False
    fp8_convert: str = "staged"
    kv_load: str = "pointer"
    pdl: bool = True
    page_rows: str = "key"
    bucket_runs: str = "stream"

    def tma(self) -> bool:
        """bf16/fp8 tiles load through tensor descriptors (MXFP4 keeps pointers)."""
        return self.kv_load in ("tma", "tma_host") and self.kv_format != "mxfp4"

    def tma_mode(self, host_desc_ok: bool) -> int:
        """The split kernel's TMA constexpr (see "KV loads" in the module docstring).
        `host_desc_ok`: the target takes host-made descriptors (NVIDIA's, or the
        interpreter); AMD has no TMA unit and keeps the per-program ones."""
        if not self.tma():
            return TMA_OFF
        return TMA_HOST_DESC if self.kv_load == "tma_host" and host_desc_ok else TMA_KERNEL_DESC

    def constexprs(self, paged: bool | int, upcast: bool, nvidia: bool, sched: int = 0,
                   batch_p2: int = 1) -> dict[str, int | bool]:
        """The constexpr arguments that define the compiled split kernel. `nvidia`: the
        target takes NVIDIA PTX inline assembly (never under the interpreter). `paged`:
        False, True (a table of page rows) or PAGE_INDEX; `sched`, `batch_p2`: the
        schedule (SCHED_*) and, for the balanced ones, a power of two >= the batch."""
        return {
            "KV_FMT": FORMATS[self.kv_format], "COMPUTE": COMPUTES[self.compute],
            "BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "PAGED": paged,
            "UPCAST": upcast, "FP8_STAGED": self.fp8_convert == "staged",
            "NV_ASM": nvidia and not upcast,
            "TMA": self.tma_mode(nvidia or upcast),
            "SCHED": sched, "BATCH_P2": batch_p2,
        }

    def merge_options(self, upcast: bool, nvidia: bool) -> dict[str, int | bool]:
        """Constexprs and launch options of the second-launch merge kernel: a programmatic
        dependent launch where the target has one (sm_90, not the interpreter)."""
        pdl = self.pdl and nvidia and not upcast
        opts: dict[str, int | bool] = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                                       "PDL": pdl, "num_warps": 4, "num_stages": 1}
        if pdl:
            opts["launch_pdl"] = True
        return opts


def pool_tma(cfg: KernelConfig, page_size: int) -> bool:
    """Whether the balanced runner of `cfg` reads a pool of `page_size`-key pages through
    TMA (_attend_paged_tma): a config that loads through TMA and pages of at least a tile
    (each whole tile is then consecutive rows of the pool); tiles of 64 keys only for
    fp8 KV. bf16 at 64 keys computed wrong results on the H200 wherever a sequence ends
    inside a tile (max error 1.06, exact where every length is a multiple of 64; the
    interpreter gets it right) and spills 728-880 B on sm_90: it keeps pointer loads."""
    return cfg.tma() and page_size >= cfg.block_n and (cfg.block_n < 64
                                                       or cfg.kv_format == "fp8")


def paged_tiles(cfg: KernelConfig, page_size: int) -> bool:
    """Whether the balanced runner of `cfg` reads a pool of `page_size`-key pages with one
    page index per tile (PAGE_TILES): pointer loads, the `page_rows='tile'` knob, and pages
    of at least a tile. Its tile loop then addresses rows as the contiguous cache's does
    (sm_90, 64-key fp8 tiles: 870 SASS instructions per tile against 1,051 with a table
    entry per key and 861 contiguous; docs/design/triton_kernel.md)."""
    return cfg.page_rows == "tile" and not pool_tma(cfg, page_size) \
        and page_size >= cfg.block_n


def paged_form(cfg: KernelConfig, page_size: int) -> KernelConfig:
    """`cfg` as the balanced runner over a pool of `page_size`-key pages compiles it: TMA
    where pool_tma says so, else pointer loads, a page index per tile where paged_tiles
    says so (the page size value itself is a runtime argument)."""
    return replace(cfg, kv_load="tma" if pool_tma(cfg, page_size) else "pointer",
                   page_rows="tile" if paged_tiles(cfg, page_size) else "key", page_size=1)


def paged_flag(cfg: KernelConfig) -> int:
    """The PAGED constexpr of a balanced runner's config in its paged form (paged_form)."""
    return PAGE_TILES if cfg.page_rows == "tile" else PAGE_INDEX


_KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8}


def kv_descriptors(kv: torch.Tensor, block_n: int) -> tuple[Any, Any]:
    """Host-made TMA descriptors of the whole contiguous cache `kv` ((N, 1, 576) or
    (N, 576) rows, 16-byte aligned): its nope columns in [block_n, 512] boxes and its rope
    columns in [block_n, 64] boxes (a tile is one load of each)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = kv.shape[0]
    return (TensorDescriptor(kv, [rows, D_QK.value], [D_QK.value, 1], [block_n, D_NOPE.value]),
            TensorDescriptor(kv, [rows, D_QK.value], [D_QK.value, 1], [block_n, D_ROPE.value]))


def kernel_launches(cfg: KernelConfig, *, heads: int, paged: bool | int, merge: bool,
                    target: str, sc_stride: int = 0, upcast: bool = False, sched: int = 0,
                    batch_p2: int = 1) -> list[tuple[Any, tuple, dict]]:
    """The kernels a launcher of `cfg` compiles for `target` ('cuda:90', 'hip:gfx950', ...),
    as (kernel, args, kwargs) for `warmup`: pointers as dtypes, integers with values of the
    same specialization as a real launch (`H` is specialized on divisibility by 16; the
    other integers are not specialized), host descriptors over a cache on the meta device
    (their specialization is their dtype and box). `merge` adds the second-launch merge
    kernel. Launcher and compile-ahead both build from this, so a kernel compiled ahead is
    the one the launcher finds in Triton's cache. `sched`/`batch_p2`: a balanced schedule
    (BalancedLauncher), whose kernels also take the batch (not specialized)."""
    kv = _KV_DTYPES[cfg.kv_format]
    f32, i32 = torch.float32, torch.int32
    constexprs = cfg.constexprs(paged, upcast, target.startswith("cuda"), sched, batch_p2)
    extra = {} if sched == SCHED_SPLITS else {"batch": 2, "seg_cost": 2,
                                              "CHUNKS": int(cfg.bucket_runs == "chunks")}
    desc_n = desc_r = kv
    if constexprs["TMA"] == TMA_HOST_DESC:
        desc_n, desc_r = kv_descriptors(torch.empty((1, D_QK.value), dtype=kv, device="meta"),
                                        cfg.block_n)
    split_args = (torch.bfloat16, kv, desc_n, desc_r, f32, torch.uint8, sc_stride, i32, i32,
                  i32, i32, 0, torch.bfloat16, f32, f32, i32, heads, 1, 1, 1.0,
                  int(cfg.fast_mode))
    launches = [(mla_decode_kernel, split_args,
                 dict(constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra))]
    if merge:
        merge_args = (i32, i32, f32, f32, torch.bfloat16, heads, 1, 1)
        opts = cfg.merge_options(upcast, target.startswith("cuda"))
        if sched != SCHED_SPLITS:
            opts = dict(opts, SCHED=sched, BATCH_P2=batch_p2, **extra)
        launches.append((mla_merge_kernel, merge_args, opts))
    return launches


def device_target(device: torch.device) -> str:
    """The compile target family of `device` as kernel_launches takes it: 'cuda', 'hip'
    (torch's ROCm build also calls its devices 'cuda'), or the device type (the
    interpreter's 'cpu')."""
    if device.type != "cuda":
        return device.type
    return "hip" if torch.version.hip else "cuda"


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tensors, slow, bf16 dot must be upcast)."""
    import os
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tiles_stay_inside(block_n: int, q_len: int, kv_lens: list[int]) -> bool:
    """No tile of any program reaches past that program's keys: one query per sequence (no
    causal end inside a sequence) and every length a whole number of tiles (split ends are
    tile multiples). Host-made descriptors over the whole cache are then safe."""
    return q_len == 1 and all(L % block_n == 0 for L in kv_lens)


def auto_splits(batch: int, row_blocks: int, max_kv: int, block_n: int, num_sms: int) -> int:
    """Split count giving about two waves of programs, within one split per KV tile."""
    programs = max(1, batch * row_blocks)
    want = max(1, (2 * num_sms + programs - 1) // programs)
    return max(1, min(want, triton.cdiv(max_kv, block_n), 64))


def identity_page_table(kv_lens: list[int], kv_starts: list[int],
                        page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page table over a contiguous cache: entry k of sequence b is the first physical row
    of its k-th page (kv_start_b + k * page_size), so unaligned sequence starts work."""
    entries: list[int] = []
    indptr = [0]
    for L, start in zip(kv_lens, kv_starts):
        n = -(-L // page_size)
        entries.extend(start + k * page_size for k in range(n))
        indptr.append(len(entries))
    return (torch.tensor(entries or [0], dtype=torch.int32),
            torch.tensor(indptr, dtype=torch.int32))


class MlaDecodeLauncher:
    """One built variant: buffers, page table and compiled kernels prepared once, so a call
    is only the kernel launch(es).

    The returned output tensor is owned by the launcher and overwritten by the next call
    (allocating it per call would add to every timed call)."""

    def __init__(self, cfg: KernelConfig, *, heads: int, q_len: int, kv_lens: list[int],
                 device: torch.device | str, sm_scale: float = 1.0 / math.sqrt(576),
                 page_table: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        device = torch.device(device)
        self.cfg = cfg
        self.heads = heads
        self.batch = len(kv_lens)
        self.total_q = self.batch * q_len
        self.total_rows = self.total_q * heads
        self.row_blocks = triton.cdiv(q_len * heads, cfg.block_m)
        self.upcast = interpreting()
        num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                   if device.type == "cuda" else 8)
        self.n_splits = cfg.num_splits or auto_splits(self.batch, self.row_blocks,
                                                      max(kv_lens), cfg.block_n, num_sms)
        page_size = max(cfg.page_size, 1)
        if page_size & (page_size - 1):
            raise ValueError(f"page size must be a power of two, got {page_size}")
        self.paged = page_table is not None or page_size > 1
        if cfg.tma() and self.paged:
            raise ValueError("kv_load='tma' reads the contiguous cache only; a paged layout "
                             "(page size > 1 or a page table) needs kv_load='pointer'")
        if page_table is None and self.paged:
            kv_starts = [0]
            for n in kv_lens[:-1]:
                kv_starts.append(kv_starts[-1] + n)
            page_table = identity_page_table(kv_lens, kv_starts, page_size)
        elif page_table is None:
            # Direct rows: the kernel reads no table (a per-token table of a large batch
            # took ~0.1 s of host time to build per variant).
            page_table = (torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
        self.page_shift = page_size.bit_length() - 1
        self.page_tbl = page_table[0].to(device)
        self.page_indptr = page_table[1].to(device)
        self.out = torch.empty((self.total_q, heads, D_NOPE), dtype=torch.bfloat16,
                               device=device)
        parts = self.n_splits if self.n_splits > 1 else 1
        self.part_o = torch.empty((parts, self.total_rows if parts > 1 else 1, D_NOPE),
                                  dtype=torch.float32, device=device)
        self.part_lse = torch.empty((parts, self.total_rows), dtype=torch.float32,
                                    device=device)
        self.counters = torch.zeros(self.batch * self.row_blocks, dtype=torch.int32,
                                    device=device)
        self.dummy_f32 = torch.zeros(1, dtype=torch.float32, device=device)
        self.dummy_u8 = torch.zeros(1, dtype=torch.uint8, device=device)
        self.grid = (self.row_blocks, self.n_splits, self.batch)
        self.merge_grid = (self.row_blocks, self.batch, MERGE_CHUNKS.value)
        self.qk_scale = float(sm_scale) * LOG2E
        self.target = device_target(device)
        if cfg.kv_load == "tma_host" and not tiles_stay_inside(cfg.block_n, q_len, kv_lens):
            raise ValueError(
                "kv_load='tma_host' shares one pair of descriptors between all programs, so "
                f"it needs q_len 1 and every kv length a multiple of block_n={cfg.block_n} "
                f"(got q_len {q_len}, kv lengths {sorted(set(kv_lens))[:8]}); use "
                "kv_load='tma' for this shape")
        self.constexprs = cfg.constexprs(self.paged, self.upcast,
                                         self.target.startswith("cuda"))
        self.host_desc = self.constexprs["TMA"] == TMA_HOST_DESC
        self._descs: tuple | None = None
        self.merge_opts = cfg.merge_options(self.upcast, self.target.startswith("cuda"))
        self.separate_merge = self.n_splits > 1 and not cfg.fast_mode
        # Device-side tensor descriptors are written to a per-program scratch area that
        # Triton's launcher asks its allocator for; calls hand it this buffer (grown once).
        self._scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self.device = device
        self._raw: tuple | None = None
        self.hooks_bypassed = False

    def _args(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor,
              kv_sc: torch.Tensor, sc_stride: int, qo_indptr: torch.Tensor,
              kv_indptr: torch.Tensor) -> tuple[tuple, tuple]:
        desc_n = desc_r = kv
        if self.host_desc:
            desc_n, desc_r = self._descriptors(kv)
        split_args = (q, kv, desc_n, desc_r, kv_scale, kv_sc, sc_stride, qo_indptr, kv_indptr,
                      self.page_tbl, self.page_indptr, self.page_shift, self.out, self.part_o,
                      self.part_lse, self.counters, self.heads, self.total_rows,
                      self.n_splits, self.qk_scale, int(self.cfg.fast_mode))
        merge_args = (qo_indptr, kv_indptr, self.part_o, self.part_lse, self.out, self.heads,
                      self.total_rows, self.n_splits)
        return split_args, merge_args

    def _descriptors(self, kv: torch.Tensor) -> tuple[Any, Any]:
        """The host descriptors of cache `kv`, made again only when a call brings a
        different cache (Triton's launcher encodes them for the GPU at each launch)."""
        key = (kv.data_ptr(), kv.shape[0], kv.dtype)
        if self._descs is None or self._descs[0] != key:
            self._descs = (key, kv_descriptors(kv, self.cfg.block_n))
        return self._descs[1]

    def _launch_jit(self, split_args: tuple, merge_args: tuple) -> None:
        c = self.cfg
        mla_decode_kernel[self.grid](*split_args, **self.constexprs, num_warps=c.num_warps,
                                     num_stages=c.num_stages)
        if self.separate_merge:
            mla_merge_kernel[self.merge_grid](*merge_args, **self.merge_opts)

    def _scratch_for(self, size: int, alignment: int, stream: int | None) -> torch.Tensor:
        """Triton's allocator protocol, for the descriptors' global scratch (stream-ordered
        reuse: the next call's kernel starts after this one's)."""
        if self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._scratch

    def prepare(self, sc_stride: int = 0) -> None:
        """Compile both kernels now (not on the first timed call; a kernel compiled ahead
        is loaded from Triton's cache) and keep their raw launchers, so calls skip Triton's
        per-call argument binding and cache lookup. `sc_stride` is the MXFP4 scale row
        stride."""
        if self.upcast:
            return
        from triton import knobs
        from triton.runtime import driver

        compiled = [fn.warmup(*args, grid=self.grid, **kwargs) for fn, args, kwargs
                    in kernel_launches(self.cfg, heads=self.heads, paged=self.paged,
                                       merge=self.separate_merge, target=self.target,
                                       sc_stride=sc_stride)]
        # Launch hooks (profilers; torch may install one) are not called on this path: with
        # them, Triton's own path cost ~27 us of host time per call on the H200 machine.
        self.hooks_bypassed = knobs.runtime.launch_enter_hook is not None
        self._stream = driver.active.get_current_stream
        self._dev_index = driver.active.get_current_device()
        k1 = compiled[0]
        k2 = compiled[1] if len(compiled) > 1 else None
        k1.run  # noqa: B018 - loads the module and creates the launcher
        # Constexprs (and `batch`, `seg_cost`: None here) go last, in parameter order.
        merge_cx = (self.cfg.block_m, self.cfg.block_n, self.merge_opts["PDL"], SCHED_SPLITS,
                    1, None, None, 0)
        self._raw = (k1.run, k1.function, k1.packed_metadata,
                     tuple(self.constexprs.values()) + (None, None, 0),
                     None if k2 is None else (k2.run, k2.function, k2.packed_metadata,
                                              merge_cx))
        if k2 is not None:
            k2.run  # noqa: B018

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor) -> torch.Tensor:
        """Run the variant. `kv` is the stored cache: (N, 1, 576) bf16 or fp8, or (N, 1, 288)
        uint8 for MXFP4; `kv_scale` the fp8 scale (1,); `kv_sc` the MXFP4 scale rows."""
        if kv_sc is None:
            kv_sc, sc_stride = self.dummy_u8, 0
        else:
            sc_stride = kv_sc.stride(0)
        if self.constexprs["TMA"] != TMA_OFF and kv.data_ptr() % 16:
            raise ValueError("kv_load='tma' needs a 16-byte aligned KV cache; this one starts "
                             f"at {kv.data_ptr():#x} (pass an aligned tensor or use "
                             "kv_load='pointer')")
        split_args, merge_args = self._args(q, kv, self.dummy_f32 if kv_scale is None
                                            else kv_scale, kv_sc, sc_stride, qo_indptr,
                                            kv_indptr)
        if self.constexprs["TMA"] != TMA_KERNEL_DESC:
            self._launch(split_args, merge_args)
            return self.out
        token = _allocation._allocator.set(self._scratch_for)
        try:
            self._launch(split_args, merge_args)
        finally:
            _allocation._allocator.reset(token)
        return self.out

    def _launch(self, split_args: tuple, merge_args: tuple) -> None:
        raw = self._raw
        if raw is None:
            self._launch_jit(split_args, merge_args)
            return
        run, fn, md, cx, merge = raw
        stream = self._stream(self._dev_index)
        g = self.grid
        run(g[0], g[1], g[2], stream, fn, md, None, None, None, *split_args, *cx)
        if merge is not None:
            run2, fn2, md2, cx2 = merge
            g = self.merge_grid
            run2(g[0], g[1], g[2], stream, fn2, md2, None, None, None, *merge_args, *cx2)


def _c_launch(run: Any) -> Any:
    """The compiled C `launch` function of Triton's CudaLauncher `run` (pointer arguments
    may be given to it as integers)."""
    fn = run.launch
    if type(fn).__name__ != "builtin_function_or_method":
        raise RuntimeError("unexpected Triton launcher layout: no C launch function "
                           f"(got {type(fn).__name__})")
    return fn


def _ctas_per_sm(kernel: Any, num_warps: int, props: Any) -> int:
    """Resident CTAs per SM of a compiled kernel (registers, shared memory, threads)."""
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    per_warp = -(-max(int(kernel.n_regs), 1) * 32 // 256) * 256
    by_regs = (regs // per_warp) // num_warps
    by_smem = smem // (int(kernel.metadata.shared) + 1024)
    return max(1, min(by_regs, by_smem, threads // (32 * num_warps), 32))


MERGE_FUSED, MERGE_SEPARATE = "fused", "separate"
"""BalancedLauncher merge modes: by the last program to finish a sequence (one launch; it
reads the sequence's partials one per round trip), or the second-launch merge kernel (a
PDL launch on NVIDIA; 16 programs per sequence read up to 16 partials per round trip)."""
SEG_COST = 1
"""Blocks of the stream charged for each sequence a program starts (_stream_schedule)."""
FUSED_MAX_PARTIALS = 4
"""The automatic merge mode: fused (where the config's fast_mode asks for it) while a
sequence has at most this many partials on average ((programs + batch) / batch), else the
second-launch merge: the fused merge reads partials one round trip at a time, a tail that
grows with their number."""


class BalancedLauncher:
    """A variant built for a whole length bucket with a balanced schedule: SCHED_TOKENS
    over a contiguous cache, or SCHED_PAGED over FlashInfer's paged metadata (see
    "Balanced schedule"). Its kernels compute the schedule from the lengths on the device,
    so one instance serves any lengths of its batch: grid, output, partial slots
    (programs + batch) and counters depend on the batch and the program count only.

    Programs: `programs` per row block, else whole waves of the device (CTAs resident per
    SM from the compiled kernel's registers and shared memory) nearest to the program
    count of `cfg`'s split count (`num_splits` x batch x row blocks): a tuned split count
    picks how many waves, the balanced schedule fills them evenly. `merge`: MERGE_FUSED,
    MERGE_SEPARATE, or None for the automatic choice (FUSED_MAX_PARTIALS); lazy rescaling
    follows `cfg.fast_mode` (the fused merge comes with it). `seg_cost`: see
    _stream_schedule.

    On a GPU, calls go through the compiled kernels' C launchers with the fixed arguments
    built once (pointers as integers, which Triton's launcher takes without calling
    `data_ptr` or checking them); `launch_ptrs` takes the call's pointers as integers, for
    callers that hold them already. Every pointer must be 16-byte aligned, as the kernels
    are compiled (`__call__` checks). Under the interpreter the Triton launch path runs.
    The output is the launcher's own buffer, overwritten by the next call."""

    def __init__(self, cfg: KernelConfig, *, heads: int, q_len: int, batch: int,
                 device: torch.device | str, sched: int, page_size: int = 1,
                 sm_scale: float = 1.0 / math.sqrt(576), programs: int = 0,
                 merge: str | None = None, seg_cost: int = SEG_COST) -> None:
        if sched not in (SCHED_TOKENS, SCHED_PAGED):
            raise ValueError(f"sched must be SCHED_TOKENS or SCHED_PAGED, got {sched}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page size must be a power of two, got {page_size}")
        if merge not in (None, MERGE_FUSED, MERGE_SEPARATE):
            raise ValueError(f"merge must be {MERGE_FUSED!r} or {MERGE_SEPARATE!r}, got "
                             f"{merge!r}")
        device = torch.device(device)
        self.device, self.sched, self.heads, self.q_len = device, sched, heads, q_len
        self.batch, self.page_size, self.seg_cost = batch, page_size, int(seg_cost)
        self._merge_requested = merge
        self.upcast = interpreting()
        self.target = device_target(device)
        nvidia = self.target.startswith("cuda")
        # Contiguous: per-program descriptors ('tma_host' shares one pair of descriptors,
        # whose tiles could run past a ragged sequence's end). Paged: per-program
        # descriptors over the pool where pool_tma says so, else pointer loads, one page
        # index per tile where paged_tiles says so.
        cfg = paged_form(cfg, page_size) if sched == SCHED_PAGED else replace(
            cfg, kv_load="tma" if cfg.kv_load == "tma_host" else cfg.kv_load, page_rows="key")
        self.cfg = cfg
        self.row_blocks = triton.cdiv(q_len * heads, cfg.block_m)
        self.stride = q_len * heads
        # One compiled kernel for every batch up to 256 (a bucket's batch is exact).
        self.batch_p2 = max(256, triton.next_power_of_2(batch))
        self.page_shift = page_size.bit_length() - 1
        self.paged_flag: bool | int = paged_flag(cfg) if sched == SCHED_PAGED else False
        self.constexprs = cfg.constexprs(self.paged_flag, self.upcast, nvidia, sched,
                                         self.batch_p2)
        self.kernel_desc = self.constexprs["TMA"] == TMA_KERNEL_DESC
        self.chunks = int(cfg.bucket_runs == "chunks")
        self.merge_opts = dict(cfg.merge_options(self.upcast, nvidia), SCHED=sched,
                               BATCH_P2=self.batch_p2, CHUNKS=self.chunks)
        self.merge = MERGE_FUSED
        self.separate_merge = False
        self.fast = 1
        self.qk_scale = float(sm_scale) * LOG2E
        self.out = torch.empty((batch * q_len, heads, D_NOPE), dtype=torch.bfloat16,
                               device=device)
        self.counters = torch.zeros(batch * self.row_blocks, dtype=torch.int32, device=device)
        self.dummy_f32 = torch.zeros(1, dtype=torch.float32, device=device)
        self.dummy_u8 = torch.zeros(1, dtype=torch.uint8, device=device)
        self.dummy_i32 = torch.zeros(1, dtype=torch.int32, device=device)
        self._requested = programs
        self.programs = 0
        self.slots = 0
        self._raw: tuple | None = None
        self.launch_ptrs: Any = None
        """`_launch_ptrs` once prepared on a GPU (None under the interpreter)."""
        self.scratch = torch.empty(0, dtype=torch.uint8, device=device)
        if self.upcast or device.type != "cuda":
            self.set_programs(programs or max(1, cfg.num_splits) * batch)

    def _wanted_programs(self) -> int:
        """Programs per row block: whole waves nearest to the config's program count."""
        if self._requested:
            return self._requested
        slots = self.slots
        splits = self.cfg.num_splits or 2 * slots // max(1, self.batch * self.row_blocks)
        waves = max(1, round(max(1, splits) * self.batch * self.row_blocks / slots))
        return max(1, waves * slots // self.row_blocks)

    def set_programs(self, programs: int, seg_cost: int | None = None) -> None:
        """Use `programs` programs per row block (sizes the partial slots) and, if given,
        charge `seg_cost` blocks per sequence start: runtime arguments of the same
        compiled kernels."""
        # The chunked schedule gives every sequence a program at least.
        self.programs = max(1, int(programs), self.batch if self.chunks else 1)
        if seg_cost is not None:
            self.seg_cost = int(seg_cost)
        slots = self.programs + self.batch
        self.merge = self._merge_requested or (
            MERGE_FUSED if self.cfg.fast_mode and slots <= FUSED_MAX_PARTIALS * self.batch
            else MERGE_SEPARATE)
        self.separate_merge = self.merge == MERGE_SEPARATE
        # 1: lazy rescaling and the fused merge; 2: lazy rescaling, merge kernel; 0: neither.
        self.fast = (2 if self.separate_merge else 1) if self.cfg.fast_mode else \
            (0 if self.separate_merge else 1)
        self.part_o = torch.empty((slots, self.stride, D_NOPE), dtype=torch.float32,
                                  device=self.device)
        self.part_lse = torch.empty((slots, self.stride), dtype=torch.float32,
                                    device=self.device)
        self.grid = (self.row_blocks, self.programs, 1)
        self.merge_grid = (self.row_blocks, self.batch, MERGE_CHUNKS.value)
        if self._raw is not None:
            self._build_raw()

    def prepare(self, sc_stride: int = 0) -> None:
        """Compile both kernels (loaded from Triton's cache when compiled ahead), choose the
        program count, and build the C launchers' fixed arguments."""
        if self.upcast:
            return
        launches = kernel_launches(self.cfg, heads=self.heads, paged=self.paged_flag,
                                   merge=True, target=self.target, sc_stride=sc_stride,
                                   sched=self.sched, batch_p2=self.batch_p2)
        compiled = [fn.warmup(*args, grid=(1, 1, 1), **kwargs) for fn, args, kwargs in launches]
        for k in compiled:
            k.run  # noqa: B018 - loads the module and creates the launcher
        self._compiled = compiled
        props = torch.cuda.get_device_properties(self.device)
        self.slots = props.multi_processor_count * _ctas_per_sm(compiled[0],
                                                                self.cfg.num_warps, props)
        """Programs the device holds at once (SMs x resident CTAs of the split kernel)."""
        self.set_programs(self._wanted_programs())
        self._build_raw()

    def _build_raw(self) -> None:
        from triton.runtime import driver

        k1 = self._compiled[0]
        md = k1.metadata
        scratch = None
        if md.global_scratch_size > 0:
            size = self.grid[0] * self.grid[1] * self.grid[2] * md.num_ctas * \
                md.global_scratch_size
            if self.scratch.numel() < size:
                self.scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
            scratch = self.scratch.data_ptr()
        g = self.grid
        self._stream = driver.active.get_current_stream
        self._dev = driver.active.get_current_device()
        self._head1 = (g[0], g[1], g[2])
        self._fix1 = (k1.function, md.launch_cooperative_grid, md.launch_pdl, scratch, None,
                      k1.packed_metadata, None, None, None)
        self._out_ptr = self.out.data_ptr()
        self._mid1 = (self.part_o.data_ptr(), self.part_lse.data_ptr(),
                      self.counters.data_ptr(), self.heads, self.stride, self.programs,
                      self.qk_scale, self.fast)
        self._tail1 = tuple(self.constexprs.values()) + (self.batch, self.seg_cost,
                                                         self.chunks)
        merge = None
        if self.separate_merge:
            k2 = self._compiled[1]
            m2 = k2.metadata
            mg = self.merge_grid
            merge = (_c_launch(k2.run), (mg[0], mg[1], mg[2]),
                     (k2.function, m2.launch_cooperative_grid, m2.launch_pdl, None, None,
                      k2.packed_metadata, None, None, None),
                     (self.part_o.data_ptr(), self.part_lse.data_ptr()),
                     (self.heads, self.stride, self.programs, self.cfg.block_m,
                      self.cfg.block_n, self.merge_opts["PDL"], self.sched, self.batch_p2,
                      self.batch, self.seg_cost, self.chunks))
        self._raw = (_c_launch(k1.run), merge)
        self.launch_ptrs = self._launch_ptrs

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                 page_indptr: torch.Tensor | None = None,
                 page_idx: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Run the variant. SCHED_TOKENS: `kv` the contiguous cache ((N, 1, 576) bf16/fp8,
        (N, 1, 288) uint8 MXFP4), `kv_indptr` cumulative tokens. SCHED_PAGED: `kv` the pool
        ((pages, page_size, 576) or (pages, page_size, 288)), `kv_indptr` the lengths,
        `page_indptr`/`page_idx` the page table (int32). `kv_scale`: fp8 scale (1,);
        `kv_sc`: MXFP4 scale rows. `out`: a contiguous bf16 (batch x q_len, heads, 512)
        tensor to write the output into (returned), else the launcher's own buffer."""
        if kv_sc is None:
            kv_sc, sc_stride = self.dummy_u8, 0
        else:
            sc_stride = kv_sc.stride(0)
        scale = self.dummy_f32 if kv_scale is None else kv_scale
        if page_indptr is None:
            page_indptr = page_idx = self.dummy_i32
        if out is None:
            out = self.out
        elif out.dtype != torch.bfloat16 or out.shape != self.out.shape \
                or not out.is_contiguous() or out.device != self.device:
            raise ValueError(f"out must be a contiguous bfloat16 tensor of shape "
                             f"{tuple(self.out.shape)} on {self.device}; got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        if self._raw is None:
            return self._call_jit(q, kv, scale, kv_sc, sc_stride, qo_indptr, kv_indptr,
                                  page_indptr, page_idx, out)
        ptrs = (q.data_ptr(), kv.data_ptr(), scale.data_ptr(), kv_sc.data_ptr(),
                qo_indptr.data_ptr(), kv_indptr.data_ptr(), page_idx.data_ptr(),
                page_indptr.data_ptr(), out.data_ptr())
        if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5] | ptrs[6] | ptrs[7]
                | ptrs[8]) & 15:
            raise ValueError("every tensor of a call must be 16-byte aligned (the kernels are "
                             "compiled for it); got addresses "
                             + ", ".join(f"{p:#x}" for p in ptrs))
        self._launch_ptrs(ptrs[0], ptrs[1], ptrs[2], ptrs[3], sc_stride, ptrs[4], ptrs[5],
                          ptrs[6], ptrs[7], ptrs[8])
        return out

    def _launch_ptrs(self, q: int, kv: int, scale: int, sc: int, sc_stride: int, qo: int,
                     kvp: int, page_idx: int, page_indptr: int, out: int = 0) -> torch.Tensor:
        """The launch(es) of one call from its pointers (16-byte aligned, unchecked); the
        dummies' pointers where a call has no scale, scales or page table
        (`dummy_ptrs`). `out`: the address to write the output at (0: the launcher's own
        buffer, which is returned either way)."""
        launch, merge = self._raw  # type: ignore[misc]
        stream = self._stream(self._dev)
        out = out or self._out_ptr
        launch(*self._head1, stream, *self._fix1, q, kv, kv, kv, scale, sc, sc_stride, qo, kvp,
               page_idx, page_indptr, self.page_shift, out, *self._mid1, *self._tail1)
        if merge is not None:
            launch2, head2, fix2, parts2, rest2 = merge
            launch2(*head2, stream, *fix2, qo, kvp, *parts2, out, *rest2)
        return self.out

    @property
    def dummy_ptrs(self) -> tuple[int, int, int]:
        """(fp8 scale, MXFP4 scales, page table) pointers of calls without them."""
        return self.dummy_f32.data_ptr(), self.dummy_u8.data_ptr(), self.dummy_i32.data_ptr()

    def _call_jit(self, q: torch.Tensor, kv: torch.Tensor, scale: torch.Tensor,
                  sc: torch.Tensor, sc_stride: int, qo: torch.Tensor, kvp: torch.Tensor,
                  page_indptr: torch.Tensor, page_idx: torch.Tensor, out: torch.Tensor
                  ) -> torch.Tensor:
        """The Triton launch path (the interpreter)."""
        c = self.cfg
        token = _allocation._allocator.set(self._scratch_for) if self.kernel_desc else None
        try:
            mla_decode_kernel[self.grid](
                q, kv, kv, kv, scale, sc, sc_stride, qo, kvp, page_idx, page_indptr,
                self.page_shift, out, self.part_o, self.part_lse, self.counters,
                self.heads, self.stride, self.programs, self.qk_scale, self.fast,
                **self.constexprs, batch=self.batch, seg_cost=self.seg_cost,
                CHUNKS=self.chunks, num_warps=c.num_warps, num_stages=c.num_stages)
            if self.separate_merge:
                mla_merge_kernel[self.merge_grid](qo, kvp, self.part_o, self.part_lse,
                                                  out, self.heads, self.stride,
                                                  self.programs, batch=self.batch,
                                                  seg_cost=self.seg_cost, **self.merge_opts)
        finally:
            if token is not None:
                _allocation._allocator.reset(token)
        return out

    def _scratch_for(self, size: int, alignment: int, stream: int | None) -> torch.Tensor:
        """Triton's allocator protocol, for device-made descriptors' scratch (the Triton
        launch path)."""
        if self.scratch.numel() < size:
            self.scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.scratch
