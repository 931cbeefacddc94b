// MLA decode (DeepSeek forward_absorb, decode phase) for NVIDIA Hopper, CUDA C++.
//
// One latent KV row of 576 values serves all query heads; the first 512 are also V.
// Split-KV flash decoding: mla_split computes, per (split, sequence, block of 16 query
// rows), an online-softmax partial over its share of the sequence's keys; mla_merge
// combines the splits by log-sum-exp. With SPLITS == 1 (runtime argument) mla_split
// writes the bf16 output itself and mla_merge is not launched.
//
// KV is read as stored: bf16; fp8 e4m3 with a per-tensor float scale (applied to the
// scores and the output, the tile keeps the exact e4m3 values); MXFP4 (two e2m1 per byte,
// element 2i in the low nibble, one e8m0 scale byte per 32 elements, scale row stride an
// argument). Tiles are decoded to bf16 in shared memory (exact for all three formats);
// all arithmetic is float32 on the CUDA cores.
//
// Query rows: row f of a sequence is (token f / heads, head f % heads), so a sequence's
// q rows (and output rows) are contiguous. Causality (q_len > 1): token t of a sequence
// of kv length L attends to keys [0, L - q_len + t]. Lengths come from the indptr arrays
// on the device (ragged batches).
//
// Compile-time knobs: KV_FORMAT (0 bf16, 1 fp8, 2 mxfp4), BN (keys per tile, 32 or 64),
// NW (warps per block: 4 or 8), PIPE (0: load, decode, compute in turn; 1: the next tile's
// raw bytes are copied with cp.async into a second buffer while the current one is used).
// No torch headers: `nvcc -cubin -arch=sm_90a -DKV_FORMAT=0 -DBN=64 -DNW=4 -DPIPE=1`.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#ifndef KV_FORMAT
#error "define KV_FORMAT: 0 bf16, 1 fp8, 2 mxfp4"
#endif
#ifndef BN
#error "define BN: keys per tile (32 or 64)"
#endif
#ifndef NW
#error "define NW: warps per block (4 or 8)"
#endif
#ifndef PIPE
#error "define PIPE: 0 or 1"
#endif

#define DQK 576
#define DV 512
#define ROWS 16
#define NT (32 * NW)
#define QK_PAIRS (DQK / 2)            // 288 bf16x2 per row
#define ROW_CHUNKS (DQK * 2 / 16)     // 72 uint4 per decoded bf16 row
#define COL_PAIRS (DV / 2 / NT)       // output bf16x2 columns per thread

#if KV_FORMAT == 0
#define RAW_ROW 1152
#elif KV_FORMAT == 1
#define RAW_ROW 576
#else
#define RAW_ROW 288
#endif
#define RAW_CHUNKS (RAW_ROW / 16)

#if (BN % 32) != 0 || (DV / 2) % NT != 0
#error "BN must be a multiple of 32 and 256 a multiple of 32 * NW"
#endif

// Shared layout (bytes); the family file's `shared` formula is the same sum.
#define Q_BYTES (ROWS * DQK * 2)
#define P_BYTES (ROWS * BN * 4)
#define STAT_BYTES 256
#define KV_BYTES ((KV_FORMAT == 0 && PIPE == 1) ? 0 : BN * DQK * 2)
#define RAW_BYTES (PIPE == 1 ? 2 * BN * RAW_ROW : 0)
#define SHARED_NEED (Q_BYTES + P_BYTES + STAT_BYTES + KV_BYTES + RAW_BYTES)

__device__ __forceinline__ float2 bf2f(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

__device__ __forceinline__ uint32_t f2bf2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 16 e4m3 bytes -> 16 bf16 (exact).
__device__ __forceinline__ void fp8x16_to_bf16(uint4 raw, uint4* dst) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t o[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((w[i] >> (16 * h)) & 0xffff), __NV_E4M3);
      __half2 hv = *reinterpret_cast<__half2*>(&hr);
      float2 f = __half22float2(hv);
      o[2 * i + h] = f2bf2(f.x, f.y);
    }
  }
  dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
  dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// e2m1 nibble -> float by its bits: exponent field e = m >> 1 (bias 1), mantissa m & 1.
__device__ __forceinline__ float e2m1(uint32_t nib) {
  const uint32_t m = nib & 7u;
  uint32_t bits = m >= 2 ? (((m >> 1) + 126u) << 23) | ((m & 1u) << 22) : (m ? 0x3f000000u : 0u);
  return __uint_as_float(bits | ((nib & 8u) << 28));
}

// 32 e2m1 (one scale block) -> 32 bf16 (exact: e2m1 x 2^k fits bf16).
__device__ __forceinline__ void fp4x32_to_bf16(uint4 raw, uint32_t scale_byte, uint4* dst) {
  const float s = scale_byte ? __uint_as_float(scale_byte << 23) : __uint_as_float(0x00400000u);
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t o[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const uint32_t byte = (w[i] >> (8 * b)) & 0xff;
      o[b] = f2bf2(e2m1(byte & 0xf) * s, e2m1(byte >> 4) * s);
    }
    dst[i] = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0));
}

// Decode raw rows (global memory for PIPE 0, the raw shared buffer for PIPE 1) of tokens
// [0, n_valid) of the tile into the bf16 tile `kv_s`; rows past n_valid become zeros.
template <bool FROM_GLOBAL>
__device__ __forceinline__ void decode_tile(const uint8_t* raw, const uint8_t* scales,
                                            int scale_stride, int n_valid, uint4* kv_s) {
  for (int i = threadIdx.x; i < BN * RAW_CHUNKS; i += NT) {
    const int tok = i / RAW_CHUNKS, c = i % RAW_CHUNKS;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (!FROM_GLOBAL || tok < n_valid)
      v = *reinterpret_cast<const uint4*>(raw + (size_t)tok * RAW_ROW + c * 16);
#if KV_FORMAT == 0
    kv_s[tok * ROW_CHUNKS + c] = v;
#elif KV_FORMAT == 1
    fp8x16_to_bf16(v, kv_s + tok * ROW_CHUNKS + 2 * c);
#else
    const uint32_t sb = tok < n_valid ? scales[(size_t)tok * scale_stride + c] : 127u;
    fp4x32_to_bf16(v, sb, kv_s + tok * ROW_CHUNKS + 4 * c);
#endif
  }
}

extern "C" __global__ void __launch_bounds__(NT)
mla_split(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kv,
          const void* __restrict__ kv_scale, const int* __restrict__ qo_indptr,
          const int* __restrict__ kv_indptr, float* __restrict__ part,
          __nv_bfloat16* __restrict__ out, int heads, int splits, int scale_stride,
          float sm_scale) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint32_t* q_s = reinterpret_cast<uint32_t*>(smem);                  // ROWS x 288 bf16x2
  float* p_s = reinterpret_cast<float*>(smem + Q_BYTES);              // BN x ROWS
  float* m_s = reinterpret_cast<float*>(smem + Q_BYTES + P_BYTES);    // running max
  float* l_s = m_s + ROWS;                                            // running sum
  float* a_s = l_s + ROWS;                                            // rescale factor
  uint8_t* kv_area = smem + Q_BYTES + P_BYTES + STAT_BYTES;
  uint8_t* raw_area = kv_area + KV_BYTES;

  {
    uint32_t have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < SHARED_NEED) __trap();  // launched with fewer shared bytes than the layout
  }

  const int split = blockIdx.x, b = blockIdx.y;
  const int q0 = qo_indptr[b], ql = qo_indptr[b + 1] - q0;
  const int k0 = kv_indptr[b], L = kv_indptr[b + 1] - k0;
  const int rows_seq = ql * heads;
  const int f0 = blockIdx.z * ROWS;
  if (f0 >= rows_seq) return;
  const int rows = min(ROWS, rows_seq - f0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  const int tiles = (L + BN - 1) / BN;
  const int per_split = (tiles + splits - 1) / splits;
  const int t_begin = split * per_split, t_end = min(tiles, t_begin + per_split);

  float kv_mul = 1.f;
#if KV_FORMAT == 1
  kv_mul = *reinterpret_cast<const float*>(kv_scale);
#endif
  const float score_mul = sm_scale * kv_mul * 1.4426950408889634f;  // log2 domain
  const uint8_t* scales = reinterpret_cast<const uint8_t*>(kv_scale);

  // Q rows of this block into shared (rows past `rows` are zeros).
  const uint4* qg = reinterpret_cast<const uint4*>(q + ((size_t)q0 * heads + f0) * DQK);
  for (int i = threadIdx.x; i < ROWS * ROW_CHUNKS; i += NT) {
    const int r = i / ROW_CHUNKS;
    reinterpret_cast<uint4*>(q_s)[i] = r < rows ? qg[i] : make_uint4(0, 0, 0, 0);
  }
  if (threadIdx.x < ROWS) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.f;
  }
  __syncthreads();

  float acc[ROWS][2 * COL_PAIRS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int c = 0; c < 2 * COL_PAIRS; ++c) acc[r][c] = 0.f;

  // Causal limit of row r: keys <= L - ql + (f0 + r) / heads.
  auto limit_of = [&](int r) { return L - ql + (f0 + r) / heads; };

#if PIPE == 1
  auto issue = [&](int tile, int buf) {
    const int base = tile * BN;
    uint8_t* dst = raw_area + buf * BN * RAW_ROW;
    for (int i = threadIdx.x; i < BN * RAW_CHUNKS; i += NT) {
      const int tok = i / RAW_CHUNKS, c = i % RAW_CHUNKS;
      const bool valid = base + tok < L;
      const uint8_t* src = valid ? kv + (size_t)(k0 + base + tok) * RAW_ROW + c * 16 : kv;
      cp_async16(dst + (size_t)tok * RAW_ROW + c * 16, src, valid);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  if (t_begin < t_end) issue(t_begin, 0);
#endif

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int base = tile * BN;
    const int n_valid = min(BN, L - base);
#if PIPE == 1
    const int buf = (tile - t_begin) & 1;
    if (tile + 1 < t_end) {
      issue(tile + 1, buf ^ 1);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();
#if KV_FORMAT == 0
    const uint32_t* kv_s = reinterpret_cast<const uint32_t*>(raw_area + buf * BN * RAW_ROW);
#else
    decode_tile<false>(raw_area + buf * BN * RAW_ROW, scales + (size_t)(k0 + base) * scale_stride,
                       scale_stride, n_valid, reinterpret_cast<uint4*>(kv_area));
    __syncthreads();
    const uint32_t* kv_s = reinterpret_cast<const uint32_t*>(kv_area);
#endif
#else
    decode_tile<true>(kv + (size_t)(k0 + base) * RAW_ROW,
                      scales + (size_t)(k0 + base) * (KV_FORMAT == 2 ? scale_stride : 0),
                      scale_stride, n_valid, reinterpret_cast<uint4*>(kv_area));
    __syncthreads();
    const uint32_t* kv_s = reinterpret_cast<const uint32_t*>(kv_area);
#endif

    // Scores: warp w takes keys n = w, w + NW, ...; lane l the bf16 pairs l + 32 i.
    for (int n = warp; n < BN; n += NW) {
      float kf[2 * (QK_PAIRS / 32)];
#pragma unroll
      for (int i = 0; i < QK_PAIRS / 32; ++i) {
        const float2 k = bf2f(kv_s[n * QK_PAIRS + lane + 32 * i]);
        kf[2 * i] = k.x;
        kf[2 * i + 1] = k.y;
      }
      float s[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < QK_PAIRS / 32; ++i) {
          const float2 qv = bf2f(q_s[r * QK_PAIRS + lane + 32 * i]);
          a = fmaf(qv.x, kf[2 * i], a);
          a = fmaf(qv.y, kf[2 * i + 1], a);
        }
        s[r] = a;
      }
      // Reduce-scatter over the warp: afterwards lanes 2j and 2j+1 hold row j's sum.
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool hi = lane & 16;
        const float send = hi ? s[j] : s[j + 8];
        const float keep = hi ? s[j + 8] : s[j];
        s[j] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool hi = lane & 8;
        const float send = hi ? s[j] : s[j + 4];
        const float keep = hi ? s[j + 4] : s[j];
        s[j] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool hi = lane & 4;
        const float send = hi ? s[j] : s[j + 2];
        const float keep = hi ? s[j + 2] : s[j];
        s[j] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
      }
      {
        const bool hi = lane & 2;
        const float send = hi ? s[0] : s[1];
        const float keep = hi ? s[1] : s[0];
        s[0] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
      }
      s[0] += __shfl_xor_sync(0xffffffffu, s[0], 1);
      if ((lane & 1) == 0) p_s[n * ROWS + ((lane >> 1) & 15)] = s[0];
    }
    __syncthreads();

    // Online softmax: warp w takes rows w, w + NW, ...; lanes the keys.
    for (int r = warp; r < ROWS; r += NW) {
      const int lim = min(limit_of(r), L - 1) - base;
      float sv[BN / 32];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < BN / 32; ++j) {
        const int n = lane + 32 * j;
        sv[j] = (n <= lim && r < rows) ? p_s[n * ROWS + r] * score_mul : -INFINITY;
        mx = fmaxf(mx, sv[j]);
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < BN / 32; ++j) {
        const float p = m_new == -INFINITY ? 0.f : exp2f(sv[j] - m_new);
        p_s[(lane + 32 * j) * ROWS + r] = p;
        sum += p;
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (lane == 0) {
        const float alpha = m_new == -INFINITY ? 1.f : exp2f(m_old - m_new);
        a_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();

    // P V: thread t owns output bf16 pairs t + NT j of all ROWS rows.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float a = a_s[r];
#pragma unroll
      for (int c = 0; c < 2 * COL_PAIRS; ++c) acc[r][c] *= a;
    }
    for (int n = 0; n < n_valid; ++n) {
      float p[ROWS];
#pragma unroll
      for (int r4 = 0; r4 < ROWS / 4; ++r4) {
        const float4 v = reinterpret_cast<const float4*>(p_s + n * ROWS)[r4];
        p[4 * r4] = v.x;
        p[4 * r4 + 1] = v.y;
        p[4 * r4 + 2] = v.z;
        p[4 * r4 + 3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < COL_PAIRS; ++j) {
        const float2 v = bf2f(kv_s[n * QK_PAIRS + threadIdx.x + NT * j]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          acc[r][2 * j] = fmaf(p[r], v.x, acc[r][2 * j]);
          acc[r][2 * j + 1] = fmaf(p[r], v.y, acc[r][2 * j + 1]);
        }
      }
    }
    __syncthreads();  // the tile and p_s are rewritten next iteration
  }

  // Results: normalized partial (or final) rows.
  const int total_rows = qo_indptr[gridDim.y] * heads;
  const size_t row0 = (size_t)q0 * heads + f0;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r >= rows) break;
    const float l = l_s[r];
    const float inv = l > 0.f ? kv_mul / l : 0.f;
    if (splits == 1) {
      uint32_t* o = reinterpret_cast<uint32_t*>(out + (row0 + r) * DV);
#pragma unroll
      for (int j = 0; j < COL_PAIRS; ++j)
        o[threadIdx.x + NT * j] = f2bf2(acc[r][2 * j] * inv, acc[r][2 * j + 1] * inv);
    } else {
      float2* o = reinterpret_cast<float2*>(part + ((row0 + r) * splits + split) * DV);
#pragma unroll
      for (int j = 0; j < COL_PAIRS; ++j)
        o[threadIdx.x + NT * j] = make_float2(acc[r][2 * j] * inv, acc[r][2 * j + 1] * inv);
      if (threadIdx.x == 0)
        part[(size_t)total_rows * splits * DV + (row0 + r) * splits + split] =
            l > 0.f ? m_s[r] + log2f(l) : -INFINITY;
    }
  }
}

// Merge: one block of 128 threads per output row; thread t owns columns 4t..4t+3.
extern "C" __global__ void __launch_bounds__(128)
mla_merge(const float* __restrict__ part, __nv_bfloat16* __restrict__ out, int splits,
          int total_rows) {
  const size_t row = blockIdx.x;
  const float* lse = part + (size_t)total_rows * splits * DV + row * splits;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, lse[s]);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float w = lse[s] == -INFINITY ? 0.f : exp2f(lse[s] - mx);
    if (w == 0.f) continue;
    const float4 v = reinterpret_cast<const float4*>(part + (row * splits + s) * DV)[threadIdx.x];
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
    wsum += w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  uint2 o = make_uint2(f2bf2(acc.x * inv, acc.y * inv), f2bf2(acc.z * inv, acc.w * inv));
  reinterpret_cast<uint2*>(out + row * DV)[threadIdx.x] = o;
}
