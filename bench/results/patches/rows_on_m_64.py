"""Prototype (measured, not in the kernel): query rows as the MMA M side, 64 rows per program, bf16 KV; wgmma for both products. See ../triton_dead_ends.md."""
import torch, triton, triton.language as tl

@triton.jit
def _tile(KV, dn, dr, kv_start, n0, hi, q, qr, offs_d, offs_r, limit, qk_scale, m_i, l_i, acc,
          BLOCK_N: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr):
    """One KV tile of the online softmax; UPCAST: float32 products (the interpreter)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    if TMA:
        k = dn.load([(kv_start + n0).to(tl.int32), 0])
        kr = dr.load([(kv_start + n0).to(tl.int32), 512])
    else:
        kp = KV + (kv_start + offs_n).to(tl.int64)[:, None] * 576
        k = tl.load(kp + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        kr = tl.load(kp + 512 + offs_r[None, :], mask=n_ok[:, None], other=0.0)
    if UPCAST:
        q, qr, k, kr = q.to(tl.float32), qr.to(tl.float32), k.to(tl.float32), kr.to(tl.float32)
    s = tl.dot(q, tl.trans(k))
    s = tl.dot(qr, tl.trans(kr), s)
    s = s * qk_scale
    s = tl.where(n_ok[None, :] & (offs_n[None, :] <= limit[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    pv = p.to(tl.bfloat16)
    if UPCAST:
        pv = pv.to(tl.float32)
    acc = tl.dot(pv, k, acc)
    return m_new, l_i, acc

@triton.jit
def rows64_kernel(Q, KV, OUT, PART_O, PART_LSE, KV_INDPTR, H, q_len, total_rows, n_splits, qk_scale,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, INTERP: tl.constexpr = False):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    kv_start = tl.load(KV_INDPTR + b)
    L = tl.load(KV_INDPTR + b + 1) - kv_start
    rows = q_len * H
    r0 = pid_m * BLOCK_M
    offs_m = r0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    grow = (b * rows + offs_m).to(tl.int64)
    offs_d = tl.arange(0, 512)
    offs_r = tl.arange(0, 64)
    n_blocks = tl.cdiv(L, BLOCK_N)
    per = tl.cdiv(n_blocks, n_splits)
    lo = split * per * BLOCK_N
    j_max = tl.minimum((r0 + BLOCK_M - 1) // H, q_len - 1)
    hi = tl.minimum(tl.minimum(lo + per * BLOCK_N, L), L - q_len + j_max + 1)
    limit = L - q_len + offs_m // H
    q = tl.load(Q + grow[:, None] * 576 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    qr = tl.load(Q + grow[:, None] * 576 + 512 + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 512], tl.float32)
    dn = KV
    dr = KV
    if TMA:
        end = (kv_start + hi).to(tl.int32)
        dn = tl.make_tensor_descriptor(KV, [end, 576], [576, 1], [BLOCK_N, 512])
        dr = tl.make_tensor_descriptor(KV, [end, 576], [576, 1], [BLOCK_N, 64])
    if INTERP:
        n0 = lo
        while n0 < hi:
            m_i, l_i, acc = _tile(KV, dn, dr, kv_start, n0, hi, q, qr, offs_d, offs_r, limit, qk_scale, m_i, l_i, acc,
                                  BLOCK_N, TMA, INTERP)
            n0 += BLOCK_N
    else:
        for n0 in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _tile(KV, dn, dr, kv_start, n0, hi, q, qr, offs_d, offs_r, limit, qk_scale, m_i, l_i, acc,
                                  BLOCK_N, TMA, INTERP)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if n_splits == 1:
        tl.store(OUT + grow[:, None] * 512 + offs_d[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])
    else:
        prow = split * total_rows + grow
        tl.store(PART_O + prow[:, None] * 512 + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(PART_LSE + prow, m_i + tl.log2(l_i), mask=row_ok)

@triton.jit
def merge_kernel(PART_O, PART_LSE, OUT, total_rows, n_splits, SPLITS_P2: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rok = r < total_rows
    offs_d = tl.arange(0, 512)
    m = tl.full([BLOCK_R], -float("inf"), tl.float32)
    for s in range(0, n_splits):
        m = tl.maximum(m, tl.load(PART_LSE + s * total_rows + r, mask=rok, other=-float("inf")))
    acc = tl.zeros([BLOCK_R, 512], tl.float32)
    den = tl.zeros([BLOCK_R], tl.float32)
    for s in range(0, n_splits):
        lse = tl.load(PART_LSE + s * total_rows + r, mask=rok, other=-float("inf"))
        w = tl.where(lse > -float("inf"), tl.exp2(lse - m), 0.0)
        o = tl.load(PART_O + (s * total_rows + r).to(tl.int64)[:, None] * 512 + offs_d[None, :], mask=rok[:, None], other=0.0)
        acc += o * w[:, None]
        den += w
    tl.store(OUT + r.to(tl.int64)[:, None] * 512 + offs_d[None, :], (acc / den[:, None]).to(tl.bfloat16), mask=rok[:, None])

class Rows64:
    def __init__(self, batch, q_len, heads, kv_len, splits, device, block_m=64, block_n=64, warps=8, stages=2, tma=True):
        self.rows = q_len * heads
        self.total = batch * self.rows
        self.splits = splits
        self.args = (heads, q_len, self.total, splits, (1 / 576 ** 0.5) * 1.4426950408889634)
        self.grid = (triton.cdiv(self.rows, block_m), splits, batch)
        self.meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma, INTERP=str(device)=='cpu', num_warps=warps, num_stages=stages)
        self.out = torch.zeros(self.total, 512, dtype=torch.bfloat16, device=device)
        self.po = torch.empty(max(splits, 1) * self.total, 512, dtype=torch.float32, device=device)
        self.pl = torch.empty(max(splits, 1) * self.total, dtype=torch.float32, device=device)
    def __call__(self, q, kv, kv_indptr):
        rows64_kernel[self.grid](q, kv, self.out, self.po, self.pl, kv_indptr, *self.args, **self.meta)
        if self.splits > 1:
            merge_kernel[(triton.cdiv(self.total, 16),)](self.po, self.pl, self.out, self.total, self.splits, SPLITS_P2=1, BLOCK_R=16, num_warps=4)
        return self.out
