// MLA decode for NVIDIA Hopper on the tensor cores, with fp8 or MXFP4 KV decoded straight
// into mma fragments.
//
// Same contract as mla_decode_mma.cu (split-KV flash decoding, one block per (16-row
// query tile, split, sequence), mla_merge combining splits by log-sum-exp, the same
// scratch layout), but no KV tile is ever written to shared memory as bf16: the raw
// tile (fp8 bytes or packed e2m1 nibbles) is copied into a three-stage cp.async ring and
// each thread decodes the bytes its own mma fragments need into registers. That cuts the
// shared-memory traffic per key 3-4x (the limit of a decoded-tile kernel) and leaves the
// decode on the ALUs beside the tensor pipe.
//
// Per KV tile of BN keys, the block's 4 warps share one 16-row query tile:
//   S = Q K^T   warp w takes 9 of the 36 16-dim k-steps for all BN keys (its Q fragments
//               stay in registers); the four partial score tiles meet in shared memory
//               and warp w sums the keys [w BN/4, (w+1) BN/4).
//   softmax     row maxima meet across the warps through shared memory; each warp keeps
//               the running max and its own partial row sums.
//   O += P V    P (bf16) goes through shared memory; warp w owns 128 output columns.
// The ring's third stage is what lets a tile start without waiting for the slowest warp
// to leave the previous one (three barriers per tile).
//
// Fragment layouts (mma.sync m16n8k16: B fragment b0 = rows 2t, 2t+1, b1 = rows 2t+8,
// 2t+9 of the 16 k-rows, column g; t = lane % 4, g = lane / 4):
//   K (k = dims, column = key): fp8: thread t takes bytes 4t..4t+3 of the k-step's 16,
//     b0 = its dims 4t, 4t+1 and b1 = 4t+2, 4t+3. MXFP4: a pair of k-steps is one
//     32-element scale block; thread t takes word t of the block's four and decodes
//     elements k and k + 4 of it into one bf16x2 (b0, b1 = elements 0/4, 1/5 for the
//     block's first k-step, 2/6, 3/7 for its second). Q's A fragments are loaded in the
//     same order (the scores do not change).
//   V (k = keys, column = dim): b0 pairs one dim of keys 2t and 2t + 1, so the two keys'
//     bytes are interleaved first (one byte_perm per word) and decoded together. Thread g
//     of warp w takes dims 128 w + 16 g .. + 15 (one per n-tile), so its output columns
//     are 128 w + 32 t + n and 128 w + 32 t + 16 + n for n-tile n, put back when stored.
// MXFP4 block scales: each tile's E8M0 bytes become bf16 multipliers 2^(s - 1) in shared
// memory (one multiply then restores e2m1 x 2^(s - 127) from the decoded bits); a tile
// with a scale byte above 128, where 2^(s - 1) is no bf16, takes a second multiply.
// fp8's per-tensor scale is applied to the scores and the output.
//
// Query rows: row f of a sequence is (token f / heads, head f % heads). Causality
// (q_len > 1): token t of a sequence of kv length L attends to keys [0, L - q_len + t].
// Lengths come from the indptr arrays on the device (ragged batches).
//
// Compile-time knobs: KV_FORMAT (1 fp8, 2 mxfp4), BN (keys per tile: 32 or 64), OCC (blocks
// per SM the register allocation is bounded for: 2 or 3; the decode is latency-bound at
// two, four warps each).
// No torch headers: `nvcc -cubin -arch=sm_90a -DKV_FORMAT=2 -DBN=64 -DOCC=2`.

#include <type_traits>

#include "mla_common.cuh"

#ifndef KV_FORMAT
#error "define KV_FORMAT: 1 fp8, 2 mxfp4"
#endif
#ifndef BN
#error "define BN: keys per tile (32 or 64)"
#endif
#if BN != 32 && BN != 64
#error "BN must be 32 or 64"
#endif
#ifndef OCC
#error "define OCC: blocks per SM the registers are budgeted for (2 or 3)"
#endif
#if KV_FORMAT != 1 && KV_FORMAT != 2
#error "this kernel decodes fp8 (1) or mxfp4 (2) KV"
#endif

#define NT 128
#define STAGES 3
#define NTILES (BN / 8)             // n-tiles of 8 keys per tile (the S product)
#define OWN_TILES (NTILES / 4)      // n-tiles whose scores a warp sums
#define PSTRIDE ((BN + 8) * 2)      // bytes per P row in shared (ldmatrix: distinct banks)
#define SCALE_BLOCKS (DQK / 32)     // 18 MXFP4 blocks per row

#if KV_FORMAT == 1
#define RAW_ROW 576
#else
#define RAW_ROW 288
#endif
#define RS (RAW_ROW + 16)           // shared row stride: conflict-free fragment loads
#define RAW_CHUNKS (RAW_ROW / 16)
#define CHUNKS (BN * RAW_CHUNKS)
#define SCALES (BN * SCALE_BLOCKS)
#define SCALES_PER_THREAD ((SCALES + NT - 1) / NT)

// Shared layout (bytes); the family file's `shared` formula is the same sum.
#define RING_BYTES (STAGES * BN * RS)
#define MUL_BYTES (KV_FORMAT == 2 ? 2 * 2 * SCALES * 2 : 0)  // 2 slots x (m1, m2) x u16
#define PART_BYTES (4 * NTILES * 32 * 16)
#define P_BYTES (16 * PSTRIDE)
#define RED_BYTES (4 * 16 * 4)
#define QSTRIDE (DQK * 2 + 16)      // bytes per Q row in shared (ldmatrix: distinct banks)
#define Q_BYTES (16 * QSTRIDE)
#define SHARED_NEED (RING_BYTES + MUL_BYTES + PART_BYTES + P_BYTES + RED_BYTES + Q_BYTES)

extern "C" __global__ void __launch_bounds__(NT, OCC)
mla_split(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kv,
          const void* __restrict__ kv_scale, const int* __restrict__ qo_indptr,
          const int* __restrict__ kv_indptr, float* __restrict__ part,
          __nv_bfloat16* __restrict__ out, int heads, int splits, int scale_stride,
          float sm_scale) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  uint16_t* mul_s = reinterpret_cast<uint16_t*>(ring + RING_BYTES);  // [slot][m1|m2][blk][key]
  float4* part_s = reinterpret_cast<float4*>(ring + RING_BYTES + MUL_BYTES);
  uint8_t* p_s = reinterpret_cast<uint8_t*>(part_s) + PART_BYTES;
  float* red_s = reinterpret_cast<float*>(p_s + P_BYTES);
  uint8_t* q_s = p_s + P_BYTES + RED_BYTES;
  {
    uint32_t have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < SHARED_NEED) __trap();  // launched with fewer shared bytes than the layout
  }

  const int split = blockIdx.y, b = blockIdx.z;
  const int q0 = qo_indptr[b], ql = qo_indptr[b + 1] - q0;
  const int k0 = kv_indptr[b], L = kv_indptr[b + 1] - k0;
  const int rows_seq = ql * heads;
  const int f0 = blockIdx.x * 16;
  if (f0 >= rows_seq) return;
  const int rows = min(16, rows_seq - f0);
  const int lane = threadIdx.x & 31, wq = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;

  const int tiles = (L + BN - 1) / BN;
  const int per_split = (tiles + splits - 1) / splits;
  const int t_begin = split * per_split, t_end = min(tiles, t_begin + per_split);

  float kv_mul = 1.f;
#if KV_FORMAT == 1
  kv_mul = *reinterpret_cast<const float*>(kv_scale);
#endif
  const float score_mul = sm_scale * kv_mul * 1.4426950408889634f;  // log2 domain
#if KV_FORMAT == 2
  const uint8_t* scales = reinterpret_cast<const uint8_t*>(kv_scale);
#endif

  // Issue a tile's raw bytes into its ring stage (one commit group per call, empty past
  // the split's end).
  auto issue = [&](int tile) {
    if (tile < t_end) {
      const int base = tile * BN;
      const uint32_t dst = smem_addr(ring + ((tile - t_begin) % STAGES) * BN * RS);
      for (int i = threadIdx.x; i < CHUNKS; i += NT) {
        const int tok = i / RAW_CHUNKS, c = i % RAW_CHUNKS;
        const bool valid = base + tok < L;
        const uint8_t* src = valid ? kv + (size_t)(k0 + base + tok) * RAW_ROW + c * 16 : kv;
        cp_async16(dst + tok * RS + c * 16, src, valid);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  // MXFP4: a tile's scale bytes, read a tile ahead (127, a unit scale, past the end).
#if KV_FORMAT == 2
  uint32_t sb[SCALES_PER_THREAD];
#endif
  auto load_scales = [&](int tile) {
#if KV_FORMAT == 2
    const int base = tile * BN;
#pragma unroll
    for (int j = 0; j < SCALES_PER_THREAD; ++j) {
      const int i = threadIdx.x + NT * j, tok = i / SCALE_BLOCKS, blk = i % SCALE_BLOCKS;
      sb[j] = tile < t_end && i < SCALES && base + tok < L
                  ? scales[(size_t)(k0 + base + tok) * scale_stride + blk]
                  : 127u;
    }
#else
    (void)tile;
#endif
  };

  // Q rows into shared in the order the K fragments hold the dims: position p of k-step
  // ks (16 positions) is the dim the B fragment's row p holds (file comment), so one
  // ldmatrix per k-step gives the A fragments. Rows past `rows` are zeros.
  for (int i = threadIdx.x; i < 16 * (DQK / 2); i += NT) {
    const int r = i / (DQK / 2), pp = i % (DQK / 2);  // a pair of positions 2 pp, 2 pp + 1
    const int ks = pp >> 3, tt = (pp & 7) & 3, hi = (pp & 7) >> 2;
    uint32_t v = 0u;
    if (r < rows) {
      const uint16_t* qr = reinterpret_cast<const uint16_t*>(q + ((size_t)q0 * heads + f0 + r) * DQK);
#if KV_FORMAT == 1
      const int d = 16 * ks + 4 * tt + 2 * hi;  // positions 2t, 2t+1 (+8): dims 4t, 4t+1 (+2)
      v = qr[d] | (uint32_t)qr[d + 1] << 16;
#else
      const int d = 32 * (ks >> 1) + 8 * tt + 2 * (ks & 1) + hi;  // elements k and k + 4
      v = qr[d] | (uint32_t)qr[d + 4] << 16;
#endif
    }
    *reinterpret_cast<uint32_t*>(q_s + r * QSTRIDE + ks * 32 + (2 * tt + 8 * hi) * 2) = v;
  }
  const uint32_t q_lane = smem_addr(q_s + (lane & 15) * QSTRIDE + (lane >> 4) * 16) +
                          9 * wq * 32;

  // Rows g and g + 8: causal key limits (-1: padding row, no keys).
  int lim[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    lim[h] = r < rows ? min(L - ql + (f0 + r) / heads, L - 1) : -1;
  }
  float m_run[2] = {-INFINITY, -INFINITY}, l_part[2] = {0.f, 0.f};
  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;

  const uint32_t p_lane = smem_addr(p_s + (lane & 15) * PSTRIDE + (lane >> 4) * 16);
  const int key0 = wq * (BN / 4);

  issue(t_begin);
  issue(t_begin + 1);
  load_scales(t_begin);

  // One tile's scores, softmax and P V; BIG: some scale byte of the tile is above 128.
  auto attend = [&](const uint8_t* tile_s, const uint16_t* m1_s, const uint16_t* m2_s,
                    int base, auto big_tag) {
    constexpr bool BIG = decltype(big_tag)::value;
    (void)m1_s;
    (void)m2_s;
    (void)big_tag;
    (void)BIG;
    float sp[NTILES][4];
#pragma unroll
    for (int n = 0; n < NTILES; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) sp[n][e] = 0.f;
#if KV_FORMAT == 1
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      const uint8_t* col = tile_s + g * RS + (9 * wq + i) * 16 + 4 * t;
      uint32_t qa[4];
      ldsm_x4(q_lane + i * 32, qa);
#pragma unroll
      for (int n = 0; n < NTILES; ++n) {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(col + 8 * n * RS);
        mma_bf16(sp[n], qa, e4m3_odd_bytes_to_bf16x2(__byte_perm(w, 0, 0x1404)),
                 e4m3_odd_bytes_to_bf16x2(__byte_perm(w, 0, 0x3424)));
      }
    }
#else
    // Scale block `blk`: its first k-step (the warp's k-step ia) if HA, its second (ia + 1)
    // if HB; a half a warp does not own is another warp's.
    auto kblock = [&](int blk, int ia, auto ha, auto hb) {
      constexpr bool HA = decltype(ha)::value, HB = decltype(hb)::value;
      uint32_t qa[4], qb[4];
      if constexpr (HA) ldsm_x4(q_lane + ia * 32, qa);
      if constexpr (HB) ldsm_x4(q_lane + (ia + HA) * 32, qb);
      const uint8_t* col = tile_s + g * RS + blk * 16 + 4 * t;
#pragma unroll
      for (int n = 0; n < NTILES; ++n) {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(col + 8 * n * RS);
        const uint32_t m = m1_s[blk * BN + 8 * n + g] * 0x10001u;
        const uint32_t m2 = BIG ? m2_s[blk * BN + 8 * n + g] * 0x10001u : 0u;
        auto dec = [&](uint32_t bits) {
          const uint32_t r = bf2_mul(bits, m);
          return BIG ? bf2_mul(r, m2) : r;
        };
        if constexpr (HA) mma_bf16(sp[n], qa, dec(e2m1_pair_bits<0>(w)), dec(e2m1_pair_bits<1>(w)));
        if constexpr (HB) mma_bf16(sp[n], qb, dec(e2m1_pair_bits<2>(w)), dec(e2m1_pair_bits<3>(w)));
      }
    };
    const std::true_type yes;
    const std::false_type no;
    // Warp w's k-steps 9w .. 9w + 8: four whole blocks and half of a fifth.
    if (wq & 1) {
      const int b0 = (9 * wq - 1) / 2;
      kblock(b0, 0, no, yes);
#pragma unroll
      for (int f = 0; f < 4; ++f) kblock(b0 + 1 + f, 1 + 2 * f, yes, yes);
    } else {
      const int b0 = 9 * wq / 2;
#pragma unroll
      for (int f = 0; f < 4; ++f) kblock(b0 + f, 2 * f, yes, yes);
      kblock(b0 + 4, 8, yes, no);
    }
#endif
#pragma unroll
    for (int n = 0; n < NTILES; ++n)
      part_s[(wq * NTILES + n) * 32 + lane] = make_float4(sp[n][0], sp[n][1], sp[n][2], sp[n][3]);
    __syncthreads();

    // The warp's keys: the four partials summed, masked, scaled; row maxima.
    float s[OWN_TILES][4];
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < OWN_TILES; ++j) {
      const int n = wq * OWN_TILES + j;
      float4 v = part_s[n * 32 + lane];
#pragma unroll
      for (int w = 1; w < 4; ++w) {
        const float4 u = part_s[(w * NTILES + n) * 32 + lane];
        v.x += u.x;
        v.y += u.y;
        v.z += u.z;
        v.w += u.w;
      }
      const float raw[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const int key = base + key0 + 8 * j + 2 * t + (e & 1);
        s[j][e] = key <= lim[h] ? raw[e] * score_mul : -INFINITY;
        mx[h] = fmaxf(mx[h], s[j][e]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if (t == 0) red_s[wq * 16 + g + 8 * h] = mx[h];
    }
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m_new = m_run[h];
#pragma unroll
      for (int w = 0; w < 4; ++w) m_new = fmaxf(m_new, red_s[w * 16 + g + 8 * h]);
      alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m_run[h] - m_new);
      m_run[h] = m_new;
      l_part[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < OWN_TILES; ++j) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        p[e] = m_run[h] == -INFINITY ? 0.f : exp2f(s[j][e] - m_run[h]);
        l_part[h] += p[e];
      }
      const int col = (key0 + 8 * j + 2 * t) * 2;
      *reinterpret_cast<uint32_t*>(p_s + g * PSTRIDE + col) = f2bf2(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(p_s + (g + 8) * PSTRIDE + col) = f2bf2(p[2], p[3]);
    }
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }
    __syncthreads();

    // O += P V: keys 16 kk + {2t, 2t+1} (b0) and {2t+8, 2t+9} (b1), dims 128 w + 16 g + n.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      ldsm_x4(p_lane + kk * 32, a);
      const int ka = 16 * kk + 2 * t;
#if KV_FORMAT == 1
      const uint8_t* vcol = tile_s + ka * RS + 128 * wq + 16 * g;
      const uint4 va = *reinterpret_cast<const uint4*>(vcol);
      const uint4 vb = *reinterpret_cast<const uint4*>(vcol + RS);
      const uint4 vc = *reinterpret_cast<const uint4*>(vcol + 8 * RS);
      const uint4 vd = *reinterpret_cast<const uint4*>(vcol + 9 * RS);
      const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
      const uint32_t wc[4] = {vc.x, vc.y, vc.z, vc.w}, wd[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        // byte n % 4 of both keys into bytes 1 and 3
        const uint32_t sel = (n & 3) * 0x0011u + (4 + (n & 3)) * 0x1100u;
        mma_bf16(acc[n], a, e4m3_odd_bytes_to_bf16x2(__byte_perm(wa[n >> 2], wb[n >> 2], sel)),
                 e4m3_odd_bytes_to_bf16x2(__byte_perm(wc[n >> 2], wd[n >> 2], sel)));
      }
#else
      const uint8_t* vcol = tile_s + ka * RS + 64 * wq + 8 * g;
      const uint2 va = *reinterpret_cast<const uint2*>(vcol);
      const uint2 vb = *reinterpret_cast<const uint2*>(vcol + RS);
      const uint2 vc = *reinterpret_cast<const uint2*>(vcol + 8 * RS);
      const uint2 vd = *reinterpret_cast<const uint2*>(vcol + 9 * RS);
      const int blk = 4 * wq + (g >> 1);
      const uint32_t mab = *reinterpret_cast<const uint32_t*>(m1_s + blk * BN + ka);
      const uint32_t mcd = *reinterpret_cast<const uint32_t*>(m1_s + blk * BN + ka + 8);
      uint32_t m2ab = 0u, m2cd = 0u;
      if (BIG) {
        m2ab = *reinterpret_cast<const uint32_t*>(m2_s + blk * BN + ka);
        m2cd = *reinterpret_cast<const uint32_t*>(m2_s + blk * BN + ka + 8);
      }
      // Low / high halves of each word of both keys: elements 0-3 / 4-7 of key 2t in the
      // low half, of key 2t + 1 in the high half, so pair k is one dim of both keys.
      const uint32_t xab[4] = {__byte_perm(va.x, vb.x, 0x5410), __byte_perm(va.x, vb.x, 0x7632),
                               __byte_perm(va.y, vb.y, 0x5410), __byte_perm(va.y, vb.y, 0x7632)};
      const uint32_t xcd[4] = {__byte_perm(vc.x, vd.x, 0x5410), __byte_perm(vc.x, vd.x, 0x7632),
                               __byte_perm(vc.y, vd.y, 0x5410), __byte_perm(vc.y, vd.y, 0x7632)};
      auto dec = [&](uint32_t bits, uint32_t m, uint32_t m2) {
        const uint32_t r = bf2_mul(bits, m);
        return BIG ? bf2_mul(r, m2) : r;
      };
#pragma unroll
      for (int h4 = 0; h4 < 4; ++h4) {
        mma_bf16(acc[4 * h4 + 0], a, dec(e2m1_pair_bits<0>(xab[h4]), mab, m2ab),
                 dec(e2m1_pair_bits<0>(xcd[h4]), mcd, m2cd));
        mma_bf16(acc[4 * h4 + 1], a, dec(e2m1_pair_bits<1>(xab[h4]), mab, m2ab),
                 dec(e2m1_pair_bits<1>(xcd[h4]), mcd, m2cd));
        mma_bf16(acc[4 * h4 + 2], a, dec(e2m1_pair_bits<2>(xab[h4]), mab, m2ab),
                 dec(e2m1_pair_bits<2>(xcd[h4]), mcd, m2cd));
        mma_bf16(acc[4 * h4 + 3], a, dec(e2m1_pair_bits<3>(xab[h4]), mab, m2ab),
                 dec(e2m1_pair_bits<3>(xcd[h4]), mcd, m2cd));
      }
#endif
    }
  };

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int slot = (tile - t_begin) & 1;
    uint16_t* m1_s = mul_s + slot * 2 * SCALES;
    uint16_t* m2_s = m1_s + SCALES;
    int big = 0;
#if KV_FORMAT == 2
    // Multipliers of this tile: its slot was last read two tiles ago.
#pragma unroll
    for (int j = 0; j < SCALES_PER_THREAD; ++j) {
      const int i = threadIdx.x + NT * j;
      const uint32_t b = sb[j];
      if (i < SCALES) {
        const int at = (i % SCALE_BLOCKS) * BN + i / SCALE_BLOCKS;
        m1_s[at] = b <= 128u ? (b + 126u) << 7 : 0x7f00u;
        m2_s[at] = b <= 128u ? 0x3f80u : (b - 1u) << 7;
        big |= b > 128u;
      }
    }
#endif
    asm volatile("cp.async.wait_group 1;\n" ::);
    // Every warp is done with the previous tile, this tile's bytes and multipliers are in.
    big = __syncthreads_or(big);
    issue(tile + 2);
    load_scales(tile + 1);
    const uint8_t* tile_s = ring + ((tile - t_begin) % STAGES) * BN * RS;
    if (KV_FORMAT == 2 && big)
      attend(tile_s, m1_s, m2_s, tile * BN, std::true_type{});
    else
      attend(tile_s, m1_s, m2_s, tile * BN, std::false_type{});
  }
  asm volatile("cp.async.wait_group 0;\n" ::);

  // Row sums: the quad's, then the warps'.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_part[h] += __shfl_xor_sync(0xffffffffu, l_part[h], 1);
    l_part[h] += __shfl_xor_sync(0xffffffffu, l_part[h], 2);
  }
  __syncthreads();  // the last tile's maxima are read
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (t == 0) red_s[wq * 16 + g + 8 * h] = l_part[h];
  __syncthreads();
  const int total_rows = qo_indptr[gridDim.z] * heads;
  const size_t row0 = (size_t)q0 * heads + f0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= rows) continue;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) l += red_s[w * 16 + r];
    const float inv = l > 0.f ? kv_mul / l : 0.f;
    const size_t row = row0 + r;
    const int c0 = 128 * wq + 32 * t;  // columns c0 + n (from acc[n][2h]), c0 + 16 + n
    if (splits == 1) {
      uint4* o = reinterpret_cast<uint4*>(out + row * DV + c0);
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          uint32_t w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int n = 8 * v + 2 * k;
            w[k] = f2bf2(acc[n][2 * h + half] * inv, acc[n + 1][2 * h + half] * inv);
          }
          o[2 * half + v] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    } else {
      float4* o = reinterpret_cast<float4*>(part + (row * splits + split) * DV + c0);
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int n = 4 * v;
          o[4 * half + v] = make_float4(acc[n][2 * h + half] * inv, acc[n + 1][2 * h + half] * inv,
                                        acc[n + 2][2 * h + half] * inv,
                                        acc[n + 3][2 * h + half] * inv);
        }
      if (wq == 0 && t == 0)
        part[(size_t)total_rows * splits * DV + row * splits + split] =
            l > 0.f ? m_run[h] + log2f(l) : -INFINITY;
    }
  }
}
