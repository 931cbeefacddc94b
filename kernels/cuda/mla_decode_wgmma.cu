// MLA decode (DeepSeek forward_absorb, decode phase) for NVIDIA Hopper with the KV tokens on
// the MMA's M side, fp8 (e4m3, per-tensor scale) and MXFP4 KV.
//
// Same contract as mla_decode.cu (split-KV flash decoding: one block per (split, sequence,
// 16 query rows), mla_merge combining the splits by log-sum-exp, the scratch layout and the
// arguments unchanged). What differs is where the decoded KV values live: never in shared
// memory. Each thread decodes the raw bytes it needs straight into MMA operand registers.
//
// Per KV tile of 64 keys, the block (one warpgroup, 4 warps) computes
//   S^T = K Q^T  with wgmma m64n16k32 e4m3: keys on M (warp w owns keys 16w..16w+15), the 16
//                query rows on N. A = the keys' e4m3 bytes straight from the raw tile (fp8),
//                or their E2M1 values placed into e4m3 bytes by bit moves (MXFP4; exact: an
//                e2m1 value times 2^-6); B = Q in shared memory, split into two e4m3 parts
//                (hi + lo, about bf16's precision). MXFP4: one 32-element scale block per
//                k-step, so each block's product lands in a fresh accumulator and is added
//                to S^T times its keys' scales, QK_BATCH blocks per commit group and two
//                groups in flight; fp8: the blocks spread over CHAINS independent
//                accumulators (one product is short next to the tensor pipe's latency), the
//                tensor's scale applied to the scores.
//   softmax      per query row against reference maxima shared by the 4 warps, P = 2^(s -
//                m) through shared memory (f16 for fp8, bf16 for MXFP4); only when a warp's
//                keys beat a reference by more than 2^LAZY do the warps exchange maxima
//                (through shared memory) and rescale the output.
//   O^T += V^T P^T  with mma.sync m16n8k16: value dims on M (thread (w, g) owns dims
//                16 (8w + g) .. + 15, one 16- or 8-byte chunk of every key row and, MXFP4, one
//                scale block), A = V^T from the raw tile in registers, two keys' bytes
//                interleaved by a byte permute: fp8 converted to f16 pairs (exact; f16
//                products, the tensor's scale applied to the output), MXFP4 the e2m1 bits of
//                each key put in one half of a bf16x2 and multiplied by the keys' block
//                scales (exact; bf16 products); B = P^T by ldmatrix.
// Raw tiles (576 or 288 bytes per key) are copied with cp.async into a double buffer, the
// next tile's issued once every warp is past the previous one; MXFP4 scale bytes of the next
// tile wait in registers. After the first tiles a tile costs two block barriers: the tile
// ready (which also frees the other buffer, P and the maxima) and P ready. The kernel reads
// each key's bytes once and writes to shared memory only Q (once), P and the MXFP4 block
// scales.
//
// Within each 32-dim block, wgmma k-index kk holds dim e of the block: fp8 kk = e; MXFP4
// kk = 16 (e % 2) + 4 (e / 8) + (e % 8) / 2 (a raw 32-bit word's even elements, then its odd
// ones), and Q is stored in that order. Value dim m-tile m of thread (w, g): row g is dim
// 16 (8w + g) + 2m, row g + 8 the next one (MXFP4: the low and high nibble of one byte).
//
// Query rows: row f of a sequence is (token f / heads, head f % heads). Causality
// (q_len > 1): token t of a sequence of kv length L attends to keys [0, L - q_len + t].
// Lengths come from the indptr arrays on the device (ragged batches).
// No torch headers: `nvcc -cubin -arch=sm_90a -DKV_FORMAT=2 -DQK_BATCH=3` (KV_FORMAT 1: fp8).

#include <cuda_fp8.h>

#include "mla_common.cuh"

#ifndef KV_FORMAT
#error "define KV_FORMAT: 1 (fp8) or 2 (mxfp4)"
#endif
#if KV_FORMAT != 1 && KV_FORMAT != 2
#error "this kernel reads fp8 (KV_FORMAT 1) and MXFP4 (KV_FORMAT 2) caches"
#endif

#define BN 64                  // keys per tile: the wgmma's M
#define NT 128                 // one warpgroup
#define NBLK (DQK / 32)        // 18 scale blocks per key row
#if KV_FORMAT == 1
#define RAW_ROW 576
#define RAW_STRIDE 592         // 148 words: the 8 rows of a warp's loads on distinct banks
#else
#define RAW_ROW 288
#define RAW_STRIDE 304         // 76 words: the same
#endif
#define RAW_CHUNKS (RAW_ROW / 16)
#define CHUNKS_PER_THREAD (RAW_CHUNKS / 2)  // two threads per key row
#define QB_BYTES (NBLK * 512)  // one e4m3 part of Q: per block 16 rows x 32 bytes
#define PSTRIDE ((BN + 8) * 2)
#ifndef QK_BATCH
#error "define QK_BATCH: scale blocks per fence (MXFP4: per commit group); divides 18"
#endif
#if NBLK % QK_BATCH
#error "QK_BATCH must divide the 18 scale blocks"
#endif
#define CHAINS 4  // fp8: independent S^T accumulators
#define LAZY 8.f  // log2 of the largest P before the rows' maxima are exchanged

// Shared layout (bytes); the family file's `shared` formula is the same sum.
#define RAW_BYTES (2 * BN * RAW_STRIDE)
#define SC_BYTES (KV_FORMAT == 2 ? 2 * NBLK * BN * 4 : 0)
#define P_BYTES (16 * PSTRIDE)
#define RED_BYTES (4 * 16 * 4 + 16 * 4)
#define SHARED_NEED (2 * QB_BYTES + RAW_BYTES + SC_BYTES + P_BYTES + RED_BYTES)

static_assert(2 * BN == NT && 2 * CHUNKS_PER_THREAD == RAW_CHUNKS, "two threads copy each key row");

// wgmma of 64 keys x 16 rows x 32 dims, A (e4m3) from registers, B (e4m3) by descriptor;
// `accumulate` 0 overwrites d.
__device__ __forceinline__ void wgmma_e4m3(float (&d)[8], const uint32_t (&a)[4], uint64_t desc,
                                           int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Descriptor of a K-major, unswizzled B operand of 16 rows x 32 bytes: 8-row x 16-byte core
// matrices, the next 16 bytes of k at +256, the next 8 rows at +128.
__device__ __forceinline__ uint64_t q_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3ffff) >> 4) | ((uint64_t)(256 >> 4) << 16) |
         ((uint64_t)(128 >> 4) << 32);
}

// Byte of the B operand block holding row h, k-index kk.
__device__ __forceinline__ int q_byte(int h, int kk) {
  return (kk >> 4) * 256 + (h >> 3) * 128 + (h & 7) * 16 + (kk & 15);
}

#if KV_FORMAT == 1
// d += a (16x16, row) * b (16x8, col), f16 inputs, float32 accumulators.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The low / high 16 bits of x, two e4m3 values, -> f16x2 (exact).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x, int high) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(high ? x >> 16 : x & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// O^T += V^T P^T for one tile of e4m3 keys (f16 products), over its four 16-key steps:
// keys 2t, 2t+1 give the A fragment's first k pair, keys 8+2t, 9+2t its second; `chunk`
// is this thread's 16 value bytes of a key row (dims 2m and 2m + 1 for m-tile m).
__device__ __forceinline__ void value_product(float (&acc)[8][2][4], const uint8_t* raw,
                                              uint32_t p_lane, int t, int chunk) {
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) {
    uint32_t pb[4];
    ldsm_x4(p_lane + ks * 32, pb);
    const int ka = 16 * ks + 2 * t;
    const uint4 va = *reinterpret_cast<const uint4*>(raw + ka * RAW_STRIDE + chunk);
    const uint4 vb = *reinterpret_cast<const uint4*>(raw + (ka + 1) * RAW_STRIDE + chunk);
    const uint4 vc = *reinterpret_cast<const uint4*>(raw + (ka + 8) * RAW_STRIDE + chunk);
    const uint4 vd = *reinterpret_cast<const uint4*>(raw + (ka + 9) * RAW_STRIDE + chunk);
    const uint32_t wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
    const uint32_t wc[4] = {vc.x, vc.y, vc.z, vc.w}, wd[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      // Dims 2m, 2m + 1 are bytes 2 (m % 2), + 1 of word m / 2: [a, b] pairs of each.
      const uint32_t sel = (m & 1) ? 0x7362 : 0x5140;
      const uint32_t ab = __byte_perm(wa[m >> 1], wb[m >> 1], sel);
      const uint32_t cd = __byte_perm(wc[m >> 1], wd[m >> 1], sel);
      const uint32_t a[4] = {e4m3x2_to_f16x2(ab, 0), e4m3x2_to_f16x2(ab, 1), e4m3x2_to_f16x2(cd, 0),
                             e4m3x2_to_f16x2(cd, 1)};
      mma_f16(acc[m][0], a, pb[0], pb[1]);
      mma_f16(acc[m][1], a, pb[2], pb[3]);
    }
  }
}
#else
// A word of eight e2m1 (element j in bits 4j..4j+3) -> its even / odd elements as four
// e4m3 bytes each, value e2m1 x 2^-6 (magnitude bits to the exponent's low bits and the
// mantissa's top bit; e2m1's subnormal 0.5 becomes e4m3's subnormal 2^-7: exact).
__device__ __forceinline__ uint32_t e2m1_even_e4m3(uint32_t w) {
  return ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);
}
__device__ __forceinline__ uint32_t e2m1_odd_e4m3(uint32_t w) {
  return ((w >> 2) & 0x1c1c1c1cu) | (w & 0x80808080u);
}

// Keys a and b's multipliers of one scale block as a bf16x2, from their float scales
// 2^(e - 127) (bf16 exactly): WIDE 0, 2^(e - 1), the one factor that turns e2m1_pair_bits
// (units of 2^-126) into e2m1 x 2^(e - 127), for 1 <= e <= 128; WIDE 1 (a tile with a value
// scale outside that range), 2^(e - 127), applied after a first factor of 2^126.
template <bool WIDE>
__device__ __forceinline__ uint32_t pair_multiplier(float2 f) {
  const uint32_t p = __byte_perm(__float_as_uint(f.x), __float_as_uint(f.y), 0x7632);
  return WIDE ? p : p + 0x3f003f00u;
}

// Elements K and K + 4 of w (e2m1_pair_bits), times the keys' block scales.
template <bool WIDE, int K>
__device__ __forceinline__ uint32_t v_pair(uint32_t w, uint32_t mul) {
  const uint32_t v = e2m1_pair_bits<K>(w);
  return WIDE ? bf2_mul(bf2_mul(v, 0x7e807e80u), mul) : bf2_mul(v, mul);
}

// O^T += V^T P^T for one tile, over its four 16-key steps: keys 2t, 2t+1 give the A
// fragment's first k pair, keys 8+2t, 9+2t its second. `sc` is the scale row of this
// thread's value block ([key] 2^(e - 127)), `chunk` its 8 bytes of a key row.
template <bool WIDE>
__device__ __forceinline__ void value_product(float (&acc)[8][2][4], const uint8_t* raw,
                                              const float* sc, uint32_t p_lane, int t,
                                              int chunk) {
#pragma unroll
  for (int ks = 0; ks < BN / 16; ++ks) {
    uint32_t pb[4];
    ldsm_x4(p_lane + ks * 32, pb);
    const int ka = 16 * ks + 2 * t;
    const uint2 va = *reinterpret_cast<const uint2*>(raw + ka * RAW_STRIDE + chunk);
    const uint2 vb = *reinterpret_cast<const uint2*>(raw + (ka + 1) * RAW_STRIDE + chunk);
    const uint2 vc = *reinterpret_cast<const uint2*>(raw + (ka + 8) * RAW_STRIDE + chunk);
    const uint2 vd = *reinterpret_cast<const uint2*>(raw + (ka + 9) * RAW_STRIDE + chunk);
    const uint32_t mab = pair_multiplier<WIDE>(*reinterpret_cast<const float2*>(sc + ka));
    const uint32_t mcd = pair_multiplier<WIDE>(*reinterpret_cast<const float2*>(sc + ka + 8));
    // Bytes of keys (a, b) interleaved, [a.b0, a.b1, b.b0, b.b1] and so on: e2m1 elements
    // K and K + 4 of each word are one dim of the two keys.
    const uint32_t wab[4] = {__byte_perm(va.x, vb.x, 0x5410), __byte_perm(va.x, vb.x, 0x7632),
                             __byte_perm(va.y, vb.y, 0x5410), __byte_perm(va.y, vb.y, 0x7632)};
    const uint32_t wcd[4] = {__byte_perm(vc.x, vd.x, 0x5410), __byte_perm(vc.x, vd.x, 0x7632),
                             __byte_perm(vc.y, vd.y, 0x5410), __byte_perm(vc.y, vd.y, 0x7632)};
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      uint32_t a[4];
      if (m & 1) {
        a[0] = v_pair<WIDE, 2>(wab[m >> 1], mab);
        a[1] = v_pair<WIDE, 3>(wab[m >> 1], mab);
        a[2] = v_pair<WIDE, 2>(wcd[m >> 1], mcd);
        a[3] = v_pair<WIDE, 3>(wcd[m >> 1], mcd);
      } else {
        a[0] = v_pair<WIDE, 0>(wab[m >> 1], mab);
        a[1] = v_pair<WIDE, 1>(wab[m >> 1], mab);
        a[2] = v_pair<WIDE, 0>(wcd[m >> 1], mcd);
        a[3] = v_pair<WIDE, 1>(wcd[m >> 1], mcd);
      }
      mma_bf16(acc[m][0], a, pb[0], pb[1]);
      mma_bf16(acc[m][1], a, pb[2], pb[3]);
    }
  }
}
#endif

// This thread's P = 2^(s - m) (0 for masked keys) into p (registers, for the row sums) and
// into shared memory (rows x keys; f16 for fp8, bf16 for MXFP4), the B operand of P V.
__device__ __forceinline__ void store_p(float (&p)[8], const float (&s)[8], const float (&m)[4],
                                        uint8_t* p_s, int t, int key_lo) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int k = (e & 1) + 2 * (e >> 2);
    p[e] = s[e] == -INFINITY ? 0.f : exp2f(s[e] - m[k]);
    const int h = 2 * t + (e & 1) + 8 * (e >> 2), key = key_lo + 8 * ((e >> 1) & 1);
#if KV_FORMAT == 1
    reinterpret_cast<__half*>(p_s + h * PSTRIDE)[key] = __float2half_rn(p[e]);
#else
    reinterpret_cast<__nv_bfloat16*>(p_s + h * PSTRIDE)[key] = __float2bfloat16_rn(p[e]);
#endif
  }
}

extern "C" __global__ void __launch_bounds__(NT)
mla_split(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kv,
          const void* __restrict__ kv_scale, const int* __restrict__ qo_indptr,
          const int* __restrict__ kv_indptr, float* __restrict__ part,
          __nv_bfloat16* __restrict__ out, int heads, int splits, int scale_stride,
          float sm_scale) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* qhi_s = smem;
  uint8_t* qlo_s = qhi_s + QB_BYTES;
  uint8_t* raw_s = qlo_s + QB_BYTES;
  float* sc_s = reinterpret_cast<float*>(raw_s + RAW_BYTES);  // MXFP4 [block][key] 2^(e - 127)
  uint8_t* p_s = reinterpret_cast<uint8_t*>(sc_s) + SC_BYTES;
  float* red_s = reinterpret_cast<float*>(p_s + P_BYTES);     // [warp][row]
  float* qmul_s = red_s + 64;                                 // per row: 2^-k of its Q parts

  {
    uint32_t have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < SHARED_NEED) __trap();  // launched with fewer shared bytes than the layout
  }

  const int split = blockIdx.x, b = blockIdx.y;
  const int q0 = qo_indptr[b], ql = qo_indptr[b + 1] - q0;
  const int k0 = kv_indptr[b], L = kv_indptr[b + 1] - k0;
  const int rows_seq = ql * heads;
  const int f0 = blockIdx.z * 16;
  if (f0 >= rows_seq) return;
  const int rows = min(16, rows_seq - f0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  const int tiles = (L + BN - 1) / BN;
  const int per_split = (tiles + splits - 1) / splits;
  const int t_begin = split * per_split, t_end = min(tiles, t_begin + per_split);

  // Raw tiles by cp.async into the double buffer: thread 2r + h copies chunks h, h + 2, ...
  // of key row r; MXFP4: a chunk of 16 raw bytes is one 32-element block, whose scale byte
  // waits in registers.
  const int my_row = tid >> 1, my_half = tid & 1;
#if KV_FORMAT == 2
  const uint8_t* scales = reinterpret_cast<const uint8_t*>(kv_scale);
#endif
#if KV_FORMAT == 2
  uint32_t sb_next[CHUNKS_PER_THREAD], sb_cur[CHUNKS_PER_THREAD];
#endif
  auto issue = [&](int tile, int buf) {
    const int key = tile * BN + my_row;
    const bool valid = key < L;
    const size_t row = (size_t)(k0 + (valid ? key : 0));
    const uint8_t* src = kv + row * RAW_ROW + my_half * 16;
#if KV_FORMAT == 2
    const uint8_t* sc = scales + row * scale_stride + my_half;
#endif
    const uint32_t dst = smem_addr(raw_s + buf * BN * RAW_STRIDE + my_row * RAW_STRIDE + my_half * 16);
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
      cp_async16(dst + 32 * j, src + 32 * j, valid);
#if KV_FORMAT == 2
      sb_next[j] = valid ? sc[2 * j] : 127u;
#endif
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  if (t_begin < t_end) issue(t_begin, 0);

  // Q rows -> two e4m3 parts in the B operand layout, each row scaled by 2^k so that its
  // largest value is below 2^8 (rows past `rows` are zeros). Warp w quantizes rows 4w..4w+3.
  {
    const uint32_t* qg = reinterpret_cast<const uint32_t*>(q + ((size_t)q0 * heads + f0) * DQK);
#pragma unroll 1
    for (int i = 0; i < 4; ++i) {
      const int h = 4 * warp + i;
      float v[2 * DQK / 64];
      float amax = 0.f;
#pragma unroll
      for (int k = 0; k < DQK / 64; ++k) {
        const uint32_t w2 = h < rows ? qg[h * (DQK / 2) + lane + 32 * k] : 0u;
        v[2 * k] = __uint_as_float(w2 << 16);
        v[2 * k + 1] = __uint_as_float(w2 & 0xffff0000u);
        amax = fmaxf(amax, fmaxf(fabsf(v[2 * k]), fabsf(v[2 * k + 1])));
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      int ex = 0;
      frexpf(amax, &ex);  // amax < 2^ex
      const float mul = amax > 0.f ? ldexpf(1.f, 8 - ex) : 1.f;
      if (lane == 0) qmul_s[h] = 1.f / mul;
#pragma unroll
      for (int k = 0; k < 2 * DQK / 64; ++k) {
        const int d = 2 * (lane + 32 * (k / 2)) + (k & 1);  // the element's dim
        const float x = v[k] * mul;
        const __nv_fp8_e4m3 hi(x);
        const __nv_fp8_e4m3 lo(x - float(hi));
        const int e = d & 31;
        const int kk = KV_FORMAT == 1 ? e : (e & 1) * 16 + (e >> 3) * 4 + ((e & 7) >> 1);
        const int off = (d >> 5) * 512 + q_byte(h, kk);
        qhi_s[off] = hi.__x;
        qlo_s[off] = lo.__x;
      }
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // Q for the wgmma's reads
  __syncthreads();

  // This thread's query rows (the wgmma's N columns 2t, 2t+1, 8+2t, 9+2t; mma.sync's the
  // same): score multipliers (log2 domain, the parts' 2^-k, fp8's tensor scale and the
  // e2m1-as-e4m3 keys' 2^6) and causal key limits (-1: padding row). `kv_mul` also scales
  // the output (fp8's tensor scale; MXFP4's values are exact as decoded).
#if KV_FORMAT == 1
  const float kv_mul = *reinterpret_cast<const float*>(kv_scale), key_unit = 1.f;
#else
  const float kv_mul = 1.f, key_unit = 64.f;
#endif
  float smul[4], m_run[4], l_part[4];
  int lim[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int h = 2 * t + (k & 1) + 8 * (k >> 1);
    smul[k] = sm_scale * 1.4426950408889634f * kv_mul * key_unit * qmul_s[h];
    lim[k] = h < rows ? min(L - ql + (f0 + h) / heads, L - 1) : -1;
    m_run[k] = -INFINITY;
    l_part[k] = 0.f;
  }
  float acc[8][2][4];
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;

#if KV_FORMAT == 2
  // The per-block products of S^T, two batches in flight (each overwritten by its block's
  // first wgmma).
  float part_acc[2][QK_BATCH][8];
#pragma unroll
  for (int i = 0; i < QK_BATCH; ++i)
#pragma unroll
    for (int e = 0; e < 8; ++e) part_acc[0][i][e] = part_acc[1][i][e] = 0.f;
#endif
  const uint64_t dhi = q_desc(smem_addr(qhi_s)), dlo = q_desc(smem_addr(qlo_s));
  const int key_lo = 16 * warp + g;  // this thread's keys on S^T's M side: key_lo, key_lo + 8
  // This thread's value bytes in a key row (16 dims) and, MXFP4, their scale block.
  const int chunk = (KV_FORMAT == 1 ? 16 : 8) * (8 * warp + g);
#if KV_FORMAT == 2
  const int vblk = (8 * warp + g) >> 1;
#endif
  // ldmatrix lane address into P (rows x keys): rows 0-7 / 8-15 (lane / 16), keys 0-7 / 8-15
  // (lane / 8 % 2) of a 16-key step.
  const uint32_t p_lane =
      smem_addr(p_s + ((lane & 7) + (lane >> 4) * 8) * PSTRIDE + ((lane >> 3) & 1) * 16);

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int base = tile * BN;
    const int buf = (tile - t_begin) & 1;
#if KV_FORMAT == 2
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) sb_cur[j] = sb_next[j];
#endif
    asm volatile("cp.async.wait_group 0;\n" ::);  // this tile's copies, the only ones in flight
#if KV_FORMAT == 2
    // The tile's block scales as floats (a buffer per raw buffer: the previous tile's may
    // still be read); `wide`: a value block scale outside [1, 128] (the bf16 multipliers
    // then take two steps).
    float* sc_t = sc_s + buf * NBLK * BN;
    int wide = 0;
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
      const int c = 2 * j + my_half;
      const uint32_t e = sb_cur[j];
      sc_t[c * BN + my_row] = __uint_as_float(e ? e << 23 : 0x00400000u);
      wide |= c < DV / 32 && (e == 0u || e > 128u);
    }
    wide = __syncthreads_or(wide);
#else
    __syncthreads();
#endif
    // Every warp is past the previous tile, so its buffer (and P, the maxima) may be
    // rewritten: the next tile's copies go there while this one is computed.
    if (tile + 1 < t_end) issue(tile + 1, buf ^ 1);
    const uint8_t* raw = raw_s + buf * BN * RAW_STRIDE;

#if KV_FORMAT == 1
    // S^T for this warp's 16 keys x 16 rows: the keys' bytes are the A fragments (row g:
    // bytes 4t.. and 16 + 4t.. of each 32-byte block). A product of 64 x 16 x 32 is short
    // next to the tensor pipe's latency, so the 18 blocks (x both parts of Q) go to CHAINS
    // independent accumulators, summed at the end; A fragments are loaded a batch of blocks
    // at a time, one fence per batch.
    float s[8];
    {
      const uint32_t* r_lo = reinterpret_cast<const uint32_t*>(raw + key_lo * RAW_STRIDE) + t;
      const uint32_t* r_hi = reinterpret_cast<const uint32_t*>(raw + (key_lo + 8) * RAW_STRIDE) + t;
      float ch[CHAINS][8];
#pragma unroll
      for (int b0 = 0; b0 < NBLK; b0 += QK_BATCH) {
        uint32_t a[QK_BATCH][4];
#pragma unroll
        for (int i = 0; i < QK_BATCH; ++i) {
          const int c = b0 + i;
          a[i][0] = r_lo[8 * c];
          a[i][1] = r_hi[8 * c];
          a[i][2] = r_lo[8 * c + 4];
          a[i][3] = r_hi[8 * c + 4];
        }
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < QK_BATCH; ++i) {
          const int c = b0 + i;
          wgmma_e4m3(ch[c % CHAINS], a[i], dhi + c * (512 >> 4), c >= CHAINS);
          wgmma_e4m3(ch[c % CHAINS], a[i], dlo + c * (512 >> 4), 1);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        s[e] = ch[0][e];
#pragma unroll
        for (int i = 1; i < CHAINS; ++i) s[e] += ch[i][e];
      }
    }

#else
    // S^T for this warp's 16 keys x 16 rows: per scale block one product (hi and lo parts
    // of Q) into a fresh accumulator, added times the keys' scales once it completes. Blocks
    // go a batch of QK_BATCH at a time (one fence, one commit group), two batches in flight.
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    {
      const uint32_t* r_lo = reinterpret_cast<const uint32_t*>(raw + key_lo * RAW_STRIDE) + t;
      const uint32_t* r_hi = reinterpret_cast<const uint32_t*>(raw + (key_lo + 8) * RAW_STRIDE) + t;
      constexpr int NB = NBLK / QK_BATCH;
#pragma unroll
      for (int bt = 0; bt <= NB; ++bt) {
        if (bt < NB) {
          uint32_t a[QK_BATCH][4];
#pragma unroll
          for (int i = 0; i < QK_BATCH; ++i) {
            const int c = bt * QK_BATCH + i;
            const uint32_t w_lo = r_lo[4 * c], w_hi = r_hi[4 * c];
            a[i][0] = e2m1_even_e4m3(w_lo);
            a[i][1] = e2m1_even_e4m3(w_hi);
            a[i][2] = e2m1_odd_e4m3(w_lo);
            a[i][3] = e2m1_odd_e4m3(w_hi);
          }
          wgmma_fence();
#pragma unroll
          for (int i = 0; i < QK_BATCH; ++i) {
            const int c = bt * QK_BATCH + i;
            wgmma_e4m3(part_acc[bt & 1][i], a[i], dhi + c * (512 >> 4), 0);
            wgmma_e4m3(part_acc[bt & 1][i], a[i], dlo + c * (512 >> 4), 1);
          }
          wgmma_commit();
        }
        if (bt > 0) {
          if (bt < NB)
            wgmma_wait<1>();
          else
            wgmma_wait<0>();
#pragma unroll
          for (int i = 0; i < QK_BATCH; ++i) {
            const int c = (bt - 1) * QK_BATCH + i;
            const float* pa = part_acc[(bt - 1) & 1][i];
            const float sl = sc_t[c * BN + key_lo], sh = sc_t[c * BN + key_lo + 8];
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] = fmaf(pa[e], (e & 2) ? sh : sl, s[e]);
          }
        }
      }
    }
#endif
    // Masked, scaled scores; each row's maximum over this warp's keys.
    float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int k = (e & 1) + 2 * (e >> 2);
      const int key = base + key_lo + 8 * ((e >> 1) & 1);
      s[e] = key <= lim[k] ? s[e] * smul[k] : -INFINITY;
      mx[k] = fmaxf(mx[k], s[e]);
    }
    // P against the rows' reference maxima m_run, the same in every warp; a warp whose keys
    // beat a reference by more than 2^LAZY (P would pass 2^LAZY) asks for new ones, and
    // only then do the warps exchange their maxima and the output get rescaled: after the
    // first tiles the common path has one barrier, which also publishes P.
    int beat = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], o));
      beat |= mx[k] > m_run[k] + LAZY;
    }
    float p[8];
    store_p(p, s, m_run, p_s, t, key_lo);
    if (__syncthreads_or(beat)) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        if (g == 0) red_s[warp * 16 + 2 * t + (k & 1) + 8 * (k >> 1)] = mx[k];
      __syncthreads();
      float alpha[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int h = 2 * t + (k & 1) + 8 * (k >> 1);
        float m_new = m_run[k];
#pragma unroll
        for (int w = 0; w < 4; ++w) m_new = fmaxf(m_new, red_s[w * 16 + h]);
        alpha[k] = m_new == -INFINITY ? 1.f : exp2f(m_run[k] - m_new);
        m_run[k] = m_new;
        l_part[k] *= alpha[k];
      }
#pragma unroll
      for (int m = 0; m < 8; ++m)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[m][n][e] *= alpha[2 * n + (e & 1)];
      store_p(p, s, m_run, p_s, t, key_lo);
      __syncthreads();
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) l_part[(e & 1) + 2 * (e >> 2)] += p[e];

#if KV_FORMAT == 1
    value_product(acc, raw, p_lane, t, chunk);
#else
    if (wide)
      value_product<true>(acc, raw, sc_t + vblk * BN, p_lane, t, chunk);
    else
      value_product<false>(acc, raw, sc_t + vblk * BN, p_lane, t, chunk);
#endif
  }

  // Row sums: over g, then the 4 warps.
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) l_part[k] += __shfl_xor_sync(0xffffffffu, l_part[k], o);
    if (g == 0) red_s[warp * 16 + 2 * t + (k & 1) + 8 * (k >> 1)] = l_part[k];
  }
  __syncthreads();
  const int total_rows = qo_indptr[gridDim.y] * heads;
  const size_t row0 = (size_t)q0 * heads + f0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int h = 2 * t + (k & 1) + 8 * (k >> 1);
    if (h >= rows) continue;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) l += red_s[w * 16 + h];
    const float inv = l > 0.f ? kv_mul / l : 0.f;
    const size_t row = row0 + h;
    const int n = k >> 1, e0 = k & 1;  // acc[m][n][e0] dim lo, acc[m][n][e0 + 2] dim hi
    if (splits == 1) {
#pragma unroll
      for (int m = 0; m < 8; ++m)
        reinterpret_cast<uint32_t*>(out + row * DV)[8 * (8 * warp + g) + m] =
            f2bf2(acc[m][n][e0] * inv, acc[m][n][e0 + 2] * inv);
    } else {
      float* o = part + (row * splits + split) * DV;
#pragma unroll
      for (int m = 0; m < 8; ++m)
        reinterpret_cast<float2*>(o)[8 * (8 * warp + g) + m] = make_float2(acc[m][n][e0] * inv, acc[m][n][e0 + 2] * inv);
      if (warp == 0 && g == 0)
        part[(size_t)total_rows * splits * DV + row * splits + split] =
            l > 0.f ? m_run[k] + log2f(l) : -INFINITY;
    }
  }
}
