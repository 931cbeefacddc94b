// MLA decode (DeepSeek forward_absorb, decode phase) for NVIDIA Hopper on the tensor cores.
//
// Same contract as mla_decode.cu (the CUDA-core family): split-KV flash decoding, one
// block per (split, sequence, MT tiles of 16 query rows), mla_merge combining the splits
// by log-sum-exp, the scratch layout and the arguments unchanged. What differs is the
// math: both products run as warp-level mma.sync m16n8k16 (bf16 in, float32 accumulate).
//
// Per KV tile of BN keys, each group of 4 warps owns one 16-row query tile:
//   S = Q K^T   warp w of the group takes keys [w BN/4, (w+1) BN/4); Q and K fragments
//               come from shared memory with ldmatrix.
//   softmax     row maxima meet across the group's warps through shared memory; every
//               warp keeps the running max and its own partial row sums in registers.
//   O += P V    P (bf16) goes through shared memory; warp w owns output columns
//               [128 w, 128 w + 128), V fragments by ldmatrix.trans of the same tile.
// KV tiles are copied with cp.async into a double buffer while the previous tile is used.
// bf16 tiles are used as copied; fp8 e4m3 and MXFP4 tiles are decoded to bf16 in shared
// memory first (exact: every e4m3 value and every e2m1 x 2^k with the block exponent in
// bf16 range is a bf16). fp8's per-tensor scale is applied to the scores and the output.
// LOAD 2 (bf16, fp8) copies the same double buffer by the copy engine instead
// (cp.async.bulk: one instruction per row, or per tile of packed rows, completing on an
// mbarrier per buffer), and the query rows the same way: a block's loads cost a few
// instructions, not dozens per thread.
//
// Query rows: row f of a sequence is (token f / heads, head f % heads). Causality
// (q_len > 1): token t of a sequence of kv length L attends to keys [0, L - q_len + t].
// Lengths come from the indptr arrays on the device (ragged batches).
//
// MXFP4 tiles are decoded eight values per 32-bit word at a time, elements k and k + 4 of
// the word into one bf16x2: within each group of 8 columns, tile position p holds element
// p / 2 + 4 (p % 2). Q is loaded in the same order (the scores do not change) and output
// columns are put back in place when stored.
//
// Compile-time knobs: KV_FORMAT (0 bf16, 1 fp8, 2 mxfp4), BN (keys per tile: 32 or 64),
// MT (16-row query tiles per block: 1 or 2; the block has 4 * MT warps and reads each KV
// tile once for all of them), LOAD (0: cp.async double buffer of raw tiles; 1, fp8 and
// MXFP4 only: the next tile's raw bytes wait in registers while the current tile is used,
// then are decoded into the one bf16 tile, which leaves shared memory for more blocks per
// SM; 2, bf16 and fp8: the double buffer of LOAD 0 filled by bulk copies), QK (how a row
// tile's 4 warps share S: 0, by keys, Q fragments read from shared memory every tile; 1, by
// dims, each warp keeps the Q fragments of its 144 dims in registers and the partial
// scores are summed through shared memory, where Q was).
// CLUSTER (0, 8 or 16; MT 1, QK 1): each CLUSTER consecutive splits of a row tile form one
// thread block cluster and merge through distributed shared memory at the end (each block
// keeps its partial in its own shared memory, then block r combines columns
// [r DV / CLUSTER, (r + 1) DV / CLUSTER) of all of them): one launch, what small batches
// need; 16 is a non-portable cluster size. SPLITS == CLUSTER writes the output with no
// scratch round trip; SPLITS = G x CLUSTER (more blocks than one cluster per row tile
// gives, to fill the SMs) merges the G clusters' partials through scratch, each column
// share by the last of its G blocks to finish. CLUSTER_BF16 (CLUSTER > 0): 1, the blocks'
// partials are kept in bf16 for the exchange (half the distributed shared memory traffic,
// which is most of the merge's time; the merge itself sums in float32), 0 float32.
// No torch headers: `nvcc -cubin -arch=sm_90a -DKV_FORMAT=0 -DBN=64 -DMT=1 -DLOAD=0 -DQK=1
// -DCLUSTER=0 -DCLUSTER_BF16=0`.

#include <cooperative_groups.h>

#include "mla_common.cuh"

#ifndef KV_FORMAT
#error "define KV_FORMAT: 0 bf16, 1 fp8, 2 mxfp4"
#endif
#ifndef BN
#error "define BN: keys per tile (32 or 64)"
#endif
#ifndef MT
#error "define MT: 16-row query tiles per block (1 or 2)"
#endif
#ifndef QK
#error "define QK: 0 (S split by keys) or 1 (S split by dims, Q in registers)"
#endif
#ifndef LOAD
#error "define LOAD: 0 (cp.async), 1 (register prefetch; fp8, mxfp4) or 2 (bulk copies)"
#endif
#ifndef CLUSTER
#error "define CLUSTER: 0, or the splits merged in one thread block cluster (8 or 16)"
#endif
#ifndef CLUSTER_BF16
#error "define CLUSTER_BF16: 1 (cluster partials exchanged in bf16) or 0 (float32)"
#endif
#if CLUSTER_BF16 && CLUSTER == 0
#error "CLUSTER_BF16 is how a cluster's blocks exchange partials: CLUSTER > 0"
#endif
#if BN != 32 && BN != 64
#error "BN must be 32 or 64"
#endif
#if CLUSTER != 0 && (MT != 1 || QK != 1)
#error "CLUSTER merges need MT 1 and QK 1"
#endif
#if KV_FORMAT == 0 && LOAD == 1
#error "bf16 tiles are used as copied: LOAD 0 or 2"
#endif
#if KV_FORMAT == 2 && LOAD == 2
#error "LOAD 2 is bf16 and fp8 only (MXFP4 loads its scale bytes with its tiles)"
#endif

#define NW (4 * MT)
#define NT (32 * NW)
#define ROWS (16 * MT)
#define KEYS_PER_WARP (BN / 4)  // 8 or 16: one or two n-tiles of 8 keys
#define STRIDE 1168             // bytes per bf16 row in shared: 1152 + 16, so the 8 rows
                                // of an ldmatrix land on distinct banks
#define PSTRIDE ((BN + 8) * 2)  // bytes per P row in shared (same reason)

#if KV_FORMAT == 0
#define RAW_ROW 1152
#elif KV_FORMAT == 1
#define RAW_ROW 576
#else
#define RAW_ROW 288
#endif
#define RAW_CHUNKS (RAW_ROW / 16)
#define CHUNKS (BN * RAW_CHUNKS)              // 16-byte raw chunks per tile
#define CHUNKS_PER_THREAD ((CHUNKS + NT - 1) / NT)

// Shared layout (bytes); the family file's `shared` formula is the same sum. bf16 tiles
// are copied straight into the padded layout, the other formats into packed raw rows.
#define Q_BYTES (ROWS * STRIDE)
#define TILE_BYTES (BN * STRIDE)
#define RAW_STRIDE (KV_FORMAT == 0 ? STRIDE : RAW_ROW)
#define RAW_BYTES (LOAD == 1 ? 0 : 2 * BN * RAW_STRIDE)
#define DEC_BYTES (KV_FORMAT == 0 ? 0 : TILE_BYTES)
#define P_BYTES (ROWS * PSTRIDE)
#define RED_BYTES (NW * 16 * 4)
#define SHARED_NEED (Q_BYTES + RAW_BYTES + DEC_BYTES + P_BYTES + RED_BYTES)
#define OSTRIDE (DV + 4)  // floats per row of a cluster block's partial (CLUSTER > 0)
#define OSTRIDE_BF16 (DV + 8)  // the same in bf16 (CLUSTER_BF16)
static_assert(CLUSTER == 0 || RAW_BYTES + DEC_BYTES >= 16 * OSTRIDE * 4,
              "the partial of a cluster block lives where the KV tiles were");
#if CLUSTER > 0
#define CLUSTER_DIMS __cluster_dims__(CLUSTER, 1, 1)
#else
#define CLUSTER_DIMS
#endif

__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t (&r)[2]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Bytes 2i, 2i+1 of a word of e4m3 -> bf16x2 (mla_common.cuh: exact).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t w, int pair) {
  return e4m3_odd_bytes_to_bf16x2(__byte_perm(w, 0, pair ? 0x3424 : 0x1404));
}

// One 16-byte raw chunk of row `tok` -> its bf16 columns of the decoded tile. fp8: 16
// values; MXFP4: one 32-element scale block (value = e2m1 x 2^(sb - 127)).
__device__ __forceinline__ void decode_chunk(uint4 v, uint32_t sb, uint8_t* row, int c) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#if KV_FORMAT == 1
  uint32_t o[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    o[2 * k] = e4m3x2_to_bf16x2(w[k], 0);
    o[2 * k + 1] = e4m3x2_to_bf16x2(w[k], 1);
  }
  uint4* d = reinterpret_cast<uint4*>(row + c * 32);
  d[0] = make_uint4(o[0], o[1], o[2], o[3]);
  d[1] = make_uint4(o[4], o[5], o[6], o[7]);
#elif KV_FORMAT == 2
  // x 2^126 (units) and x 2^(sb - 127) in one multiply while 2^(sb - 1) is a bf16.
  const bool one = sb <= 128u;
  const uint32_t m1 = one ? ((sb + 126u) << 7) * 0x10001u : 0x7e807e80u;
  const uint32_t m2 = (sb << 7) * 0x10001u;
  uint4* d = reinterpret_cast<uint4*>(row + c * 64);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t o[4] = {e2m1_pair_bits<0>(w[k]), e2m1_pair_bits<1>(w[k]), e2m1_pair_bits<2>(w[k]),
                     e2m1_pair_bits<3>(w[k])};
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      o[b] = bf2_mul(o[b], m1);
      if (!one) o[b] = bf2_mul(o[b], m2);
    }
    d[k] = make_uint4(o[0], o[1], o[2], o[3]);
  }
#endif
}

// Output column of tile position `pos` (MXFP4 tiles hold each group of 8 permuted).
__device__ __forceinline__ int column_of(int pos) {
#if KV_FORMAT == 2
  return (pos & ~7) | ((pos & 7) >> 1) | ((pos & 1) << 2);
#else
  return pos;
#endif
}

#if LOAD == 2
// Bulk copies (the copy engine, as TMA without a tensor map) completing on mbarriers.
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
}

// The arrival of a barrier's phase, expecting `bytes` of copies to complete it.
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Rows [n, BN) of a raw tile to zeros: past the sequence's end no copy wrote them, and the
// value product multiplies them by zero weights (stale or NaN bytes would not stay zero).
__device__ __forceinline__ void zero_rows(uint8_t* raw, int n) {
  for (int i = n * (RAW_ROW / 16) + threadIdx.x; i < BN * (RAW_ROW / 16); i += NT)
    *reinterpret_cast<uint4*>(raw + (i / (RAW_ROW / 16)) * RAW_STRIDE + (i % (RAW_ROW / 16)) * 16) =
        make_uint4(0, 0, 0, 0);
}
#endif

#if CLUSTER > 0
// The end of a cluster block (MT 1; the row sums are in red_s, the KV tiles are no longer
// read): its normalized partial and log-sum-exps into its own shared memory, then its
// share of the columns merged from every block of the cluster. One cluster per row tile
// (splits == CLUSTER): the merged columns are the output. Several (splits = G x CLUSTER,
// what fills the SMs when the batch is small): each cluster's merged columns are one of
// G partials in `part`, and the last of the G blocks of the same rank to finish merges
// that rank's columns of all G into `out` (the row tile's first output row, `row0`).
__device__ __forceinline__ void cluster_merge(const float (&acc)[16][4], const float (&m_run)[2],
                                              const float* red_s, float* o_s, float kv_mul,
                                              int rows, int g, int t, int wq, int splits,
                                              float* __restrict__ part, int total_rows,
                                              size_t row0, int counter,
                                              __nv_bfloat16* __restrict__ out) {
  namespace cg = cooperative_groups;
  __shared__ float lse_s[16];
  __shared__ int merges_here;
  cg::cluster_group cluster = cg::this_cluster();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) l += red_s[w * 16 + r];
    const float inv = l > 0.f ? kv_mul / l : 0.f;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const int pos = wq * 128 + 8 * n + 2 * t;
#if CLUSTER_BF16
      __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(o_s);
      ob[r * OSTRIDE_BF16 + column_of(pos)] = __float2bfloat16_rn(acc[n][2 * h] * inv);
      ob[r * OSTRIDE_BF16 + column_of(pos + 1)] = __float2bfloat16_rn(acc[n][2 * h + 1] * inv);
#else
      o_s[r * OSTRIDE + column_of(pos)] = acc[n][2 * h] * inv;
      o_s[r * OSTRIDE + column_of(pos + 1)] = acc[n][2 * h + 1] * inv;
#endif
    }
    if (wq == 0 && t == 0) lse_s[r] = l > 0.f && r < rows ? m_run[h] + log2f(l) : -INFINITY;
  }
  cluster.sync();
  constexpr int COLS = DV / CLUSTER;  // 64 or 32 per block
  const int rank = (int)cluster.block_rank();
  const int c0 = rank * COLS;
  const int groups = splits / CLUSTER, grp = blockIdx.x / CLUSTER;
  // Scratch when groups > 1: G partials per row, then G x CLUSTER log-sum-exps per row
  // (each rank writes its own copy), then CLUSTER arrival counters per row tile.
  float* lse_g = part + (size_t)total_rows * groups * DV;
#if CLUSTER_BF16
  // Eight columns per thread, one 16-byte read of each block's bf16 partial.
  for (int i = threadIdx.x; i < rows * (COLS / 8); i += NT) {
    const int r = i / (COLS / 8), c = c0 + (i % (COLS / 8)) * 8;
    float lse[CLUSTER];
    float mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) {
      lse[s] = cluster.map_shared_rank(lse_s, s)[r];
      mx = fmaxf(mx, lse[s]);
    }
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float wsum = 0.f;
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) {
      const float w = lse[s] == -INFINITY ? 0.f : exp2f(lse[s] - mx);
      const uint4 v = *reinterpret_cast<const uint4*>(
          reinterpret_cast<const __nv_bfloat16*>(cluster.map_shared_rank(o_s, s)) +
          r * OSTRIDE_BF16 + c);
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        a[2 * k] = fmaf(w, __uint_as_float(u[k] << 16), a[2 * k]);
        a[2 * k + 1] = fmaf(w, __uint_as_float(u[k] & 0xffff0000u), a[2 * k + 1]);
      }
      wsum += w;
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    if (groups == 1) {
      *reinterpret_cast<uint4*>(out + (size_t)r * DV + c) =
          make_uint4(f2bf2(a[0] * inv, a[1] * inv), f2bf2(a[2] * inv, a[3] * inv),
                     f2bf2(a[4] * inv, a[5] * inv), f2bf2(a[6] * inv, a[7] * inv));
    } else {
      const size_t slot = (row0 + r) * groups + grp;
      __stcg(reinterpret_cast<float4*>(part + slot * DV + c),
             make_float4(a[0] * inv, a[1] * inv, a[2] * inv, a[3] * inv));
      __stcg(reinterpret_cast<float4*>(part + slot * DV + c + 4),
             make_float4(a[4] * inv, a[5] * inv, a[6] * inv, a[7] * inv));
      if (c == c0) lse_g[slot * CLUSTER + rank] = wsum > 0.f ? mx + log2f(wsum) : -INFINITY;
    }
  }
#else
  for (int i = threadIdx.x; i < rows * (COLS / 4); i += NT) {
    const int r = i / (COLS / 4), c = c0 + (i % (COLS / 4)) * 4;
    float lse[CLUSTER];
    float mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) {
      lse[s] = cluster.map_shared_rank(lse_s, s)[r];
      mx = fmaxf(mx, lse[s]);
    }
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    float wsum = 0.f;
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) {
      const float w = lse[s] == -INFINITY ? 0.f : exp2f(lse[s] - mx);
      const float4 v = *reinterpret_cast<const float4*>(cluster.map_shared_rank(o_s, s) +
                                                        r * OSTRIDE + c);
      a.x = fmaf(w, v.x, a.x);
      a.y = fmaf(w, v.y, a.y);
      a.z = fmaf(w, v.z, a.z);
      a.w = fmaf(w, v.w, a.w);
      wsum += w;
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    if (groups == 1) {
      *reinterpret_cast<uint2*>(out + (size_t)r * DV + c) =
          make_uint2(f2bf2(a.x * inv, a.y * inv), f2bf2(a.z * inv, a.w * inv));
    } else {
      const size_t slot = (row0 + r) * groups + grp;
      __stcg(reinterpret_cast<float4*>(part + slot * DV + c),
             make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv));
      if (c == c0) lse_g[slot * CLUSTER + rank] = wsum > 0.f ? mx + log2f(wsum) : -INFINITY;
    }
  }
#endif
  cluster.sync();  // no block leaves while another still reads its shared memory
  if (groups == 1) return;

  // The G blocks of this rank: partials published by a fence before the count; the
  // counter (zero from allocation) is reset by the block that merges.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* count = reinterpret_cast<int*>(lse_g + (size_t)total_rows * groups * CLUSTER) +
                 counter * CLUSTER + rank;
    merges_here = atomicAdd(count, 1) == groups - 1;
    if (merges_here) *count = 0;
  }
  __syncthreads();
  if (!merges_here) return;
  __threadfence();
  for (int i = threadIdx.x; i < rows * (COLS / 4); i += NT) {
    const int r = i / (COLS / 4), c = c0 + (i % (COLS / 4)) * 4;
    const size_t slot0 = (row0 + r) * groups;
    float mx = -INFINITY;
    for (int s = 0; s < groups; ++s) mx = fmaxf(mx, __ldcg(lse_g + (slot0 + s) * CLUSTER + rank));
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    float wsum = 0.f;
    for (int s = 0; s < groups; ++s) {
      const float l = __ldcg(lse_g + (slot0 + s) * CLUSTER + rank);
      const float w = l == -INFINITY ? 0.f : exp2f(l - mx);
      if (w == 0.f) continue;
      const float4 v = __ldcg(reinterpret_cast<const float4*>(part + (slot0 + s) * DV + c));
      a.x = fmaf(w, v.x, a.x);
      a.y = fmaf(w, v.y, a.y);
      a.z = fmaf(w, v.z, a.z);
      a.w = fmaf(w, v.w, a.w);
      wsum += w;
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    *reinterpret_cast<uint2*>(out + (size_t)r * DV + c) =
        make_uint2(f2bf2(a.x * inv, a.y * inv), f2bf2(a.z * inv, a.w * inv));
  }
}
#endif

extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(NT)
mla_split(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kv,
          const void* __restrict__ kv_scale, const int* __restrict__ qo_indptr,
          const int* __restrict__ kv_indptr, float* __restrict__ part,
          __nv_bfloat16* __restrict__ out, int heads, int splits, int merge, int scale_stride,
          float sm_scale) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int merges_here;
  uint8_t* q_s = smem;
  uint8_t* raw_s = q_s + Q_BYTES;
  uint8_t* dec_s = raw_s + RAW_BYTES;
  uint8_t* p_s = dec_s + DEC_BYTES;
  float* red_s = reinterpret_cast<float*>(p_s + P_BYTES);

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
  const int rt = warp >> 2, wq = warp & 3;  // the warp's row tile and its place in the group
  const int g = lane >> 2, t = lane & 3;    // mma fragment coordinates

  const int tiles = (L + BN - 1) / BN;
  const int per_split = (tiles + splits - 1) / splits;
  const int t_begin = split * per_split, t_end = min(tiles, t_begin + per_split);

  float kv_mul = 1.f;
#if KV_FORMAT == 1
  kv_mul = *reinterpret_cast<const float*>(kv_scale);
#endif
  const float score_mul = sm_scale * kv_mul * 1.4426950408889634f;  // log2 domain
  const uint8_t* scales = reinterpret_cast<const uint8_t*>(kv_scale);

#if LOAD == 2
  // Barriers of the two raw buffers and of the query rows; warp 0 issues every copy.
  __shared__ __align__(8) uint64_t bars[3];
  const uint32_t bar0 = smem_addr(bars), bar_q = bar0 + 16;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < 3; ++i) mbar_init(bar0 + 8 * i);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
#endif
#if LOAD != 1
  // MXFP4 scale bytes of the chunks this thread decodes: read when the tile is issued,
  // so the decode never waits on global memory.
  uint32_t sb_next[KV_FORMAT == 2 ? CHUNKS_PER_THREAD : 1], sb_cur[KV_FORMAT == 2 ? CHUNKS_PER_THREAD : 1];
  auto issue = [&](int tile, int buf) {
    const int base = tile * BN;
    const uint32_t dst = smem_addr(raw_s + buf * BN * RAW_STRIDE);
#if LOAD == 2
    if (warp == 0) {
      // The tile's rows that exist: bf16 rows one copy each (the buffer's rows are padded),
      // packed fp8 rows one copy for the tile.
      const int n = min(BN, L - base);
      const uint32_t bar = bar0 + 8 * buf;
      const uint8_t* src = kv + (size_t)(k0 + base) * RAW_ROW;
      if (lane == 0) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_expect(bar, n * RAW_ROW);
      }
      __syncwarp();
#if KV_FORMAT == 0
      for (int r = lane; r < n; r += 32)
        bulk_copy(dst + r * RAW_STRIDE, src + r * RAW_ROW, RAW_ROW, bar);
#else
      if (lane == 0) bulk_copy(dst, src, n * RAW_ROW, bar);
#endif
    }
#endif
#if KV_FORMAT == 2
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
      const int i = threadIdx.x + NT * j, tok = i / RAW_CHUNKS, c = i % RAW_CHUNKS;
      if (i >= CHUNKS) break;
      const bool valid = base + tok < L;
      const uint8_t* src = valid ? kv + (size_t)(k0 + base + tok) * RAW_ROW + c * 16 : kv;
      cp_async16(dst + tok * RAW_STRIDE + c * 16, src, valid);
      sb_next[j] = valid ? scales[(size_t)(k0 + base + tok) * scale_stride + c] : 127u;
    }
#elif LOAD == 0
    for (int i = threadIdx.x; i < CHUNKS; i += NT) {
      const int tok = i / RAW_CHUNKS, c = i % RAW_CHUNKS;
      const bool valid = base + tok < L;
      const uint8_t* src = valid ? kv + (size_t)(k0 + base + tok) * RAW_ROW + c * 16 : kv;
      cp_async16(dst + tok * RAW_STRIDE + c * 16, src, valid);
    }
#endif
#if LOAD == 0
    asm volatile("cp.async.commit_group;\n" ::);
#endif
  };
  if (t_begin < t_end) issue(t_begin, 0);
#else
  uint4 pre[CHUNKS_PER_THREAD];
  uint32_t pre_sb[CHUNKS_PER_THREAD];
  auto fetch = [&](int tile) {
    const int base = tile * BN;
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
      const int i = threadIdx.x + NT * j, tok = i / RAW_CHUNKS, c = i % RAW_CHUNKS;
      const bool valid = i < CHUNKS && base + tok < L;
      pre[j] = valid ? *reinterpret_cast<const uint4*>(kv + (size_t)(k0 + base + tok) * RAW_ROW +
                                                       c * 16)
                     : make_uint4(0, 0, 0, 0);
      pre_sb[j] = KV_FORMAT == 2 && valid ? scales[(size_t)(k0 + base + tok) * scale_stride + c]
                                          : 127u;
    }
  };
  auto store = [&]() {
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
      const int i = threadIdx.x + NT * j;
      if (i < CHUNKS) decode_chunk(pre[j], pre_sb[j], dec_s + (i / RAW_CHUNKS) * STRIDE,
                                   i % RAW_CHUNKS);
    }
  };
  if (t_begin < t_end) {
    fetch(t_begin);
    store();
  }
#endif

  // Q rows of this block into shared (rows past `rows` are zeros).
#if LOAD == 2
  if (warp == 1) {  // (warp 0 issued the first tile)
    const __nv_bfloat16* qrow = q + ((size_t)q0 * heads + f0) * DQK;
    if (lane == 0) mbar_expect(bar_q, rows * DQK * 2);
    __syncwarp();
    for (int r = lane; r < rows; r += 32)
      bulk_copy(smem_addr(q_s + r * STRIDE), qrow + r * DQK, DQK * 2, bar_q);
  }
  for (int i = rows * (DQK / 8) + threadIdx.x; i < ROWS * (DQK / 8); i += NT)
    *reinterpret_cast<uint4*>(q_s + (i / (DQK / 8)) * STRIDE + (i % (DQK / 8)) * 16) =
        make_uint4(0, 0, 0, 0);
  mbar_wait(bar_q, 0);
#else
  const uint4* qg = reinterpret_cast<const uint4*>(q + ((size_t)q0 * heads + f0) * DQK);
  for (int i = threadIdx.x; i < ROWS * (DQK / 8); i += NT) {
    const int r = i / (DQK / 8), c = i % (DQK / 8);
    uint4 v = r < rows ? qg[i] : make_uint4(0, 0, 0, 0);
#if KV_FORMAT == 2
    v = make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                   __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
#endif
    *reinterpret_cast<uint4*>(q_s + r * STRIDE + c * 16) = v;
  }
#endif

#if QK == 1
  // The warp's 9 k-steps of Q, kept for every tile; q_s then holds the partial scores.
  __syncthreads();
  uint32_t qf[9][4];
#pragma unroll
  for (int i = 0; i < 9; ++i)
    ldsm_x4(smem_addr(q_s + (rt * 16 + (lane & 15)) * STRIDE + (lane >> 4) * 16) +
                (9 * wq + i) * 32,
            qf[i]);
  float4* part_s = reinterpret_cast<float4*>(q_s + rt * 16 * STRIDE);  // [warp][n-tile][lane]
#endif

  // Rows g and g + 8 of the warp's tile: causal key limits (-1: padding row, no keys).
  int lim[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rt * 16 + g + 8 * h;
    lim[h] = r < rows ? min(L - ql + (f0 + r) / heads, L - 1) : -1;
  }
  float m_run[2] = {-INFINITY, -INFINITY}, l_part[2] = {0.f, 0.f};
  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;

  // ldmatrix lane addresses: A (16x16 row-major): row lane % 16, column (lane / 16) * 8.
  const uint32_t q_lane = smem_addr(q_s + (rt * 16 + (lane & 15)) * STRIDE + (lane >> 4) * 16);
  const uint32_t p_lane = smem_addr(p_s + (rt * 16 + (lane & 15)) * PSTRIDE + (lane >> 4) * 16);
  const int key0 = wq * KEYS_PER_WARP;

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int base = tile * BN;
#if LOAD != 1
    const int buf = (tile - t_begin) & 1;
#if KV_FORMAT == 2
#pragma unroll
    for (int j = 0; j < CHUNKS_PER_THREAD; ++j) sb_cur[j] = sb_next[j];
#endif
#if LOAD == 0
    if (tile + 1 < t_end) {
      issue(tile + 1, buf ^ 1);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
#else
    if (tile + 1 < t_end) issue(tile + 1, buf ^ 1);
    mbar_wait(bar0 + 8 * buf, ((tile - t_begin) >> 1) & 1);
    if (base + BN > L) zero_rows(raw_s + buf * BN * RAW_STRIDE, L - base);
#endif
    __syncthreads();
#if KV_FORMAT == 0
    const uint8_t* kv_s = raw_s + buf * BN * RAW_STRIDE;
#else
    {
      const uint8_t* raw = raw_s + buf * BN * RAW_STRIDE;
#pragma unroll
      for (int j = 0; j < CHUNKS_PER_THREAD; ++j) {
        const int i = threadIdx.x + NT * j, tok = i / RAW_CHUNKS, c = i % RAW_CHUNKS;
        if (i >= CHUNKS) break;
        decode_chunk(*reinterpret_cast<const uint4*>(raw + tok * RAW_ROW + c * 16),
                     KV_FORMAT == 2 ? sb_cur[KV_FORMAT == 2 ? j : 0] : 127u, dec_s + tok * STRIDE, c);
      }
    }
    __syncthreads();
    const uint8_t* kv_s = dec_s;
#endif
#else
    if (tile + 1 < t_end) fetch(tile + 1);
    __syncthreads();
    const uint8_t* kv_s = dec_s;
#endif

    // S for the warp's keys: B fragments (keys x dims, row-major = col-major B).
    float s[KEYS_PER_WARP / 8][4];
#if QK == 1
    {
      // This warp's dims for all BN keys, then the group's four partials summed.
      float sp[BN / 8][4];
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sp[n][e] = 0.f;
      const uint32_t k_lane = smem_addr(kv_s + ((lane & 7) + (lane >> 4) * 8) * STRIDE +
                                        ((lane >> 3) & 1) * 16 + 9 * wq * 32);
#pragma unroll
      for (int i = 0; i < 9; ++i)
#pragma unroll
        for (int n2 = 0; n2 < BN / 16; ++n2) {
          uint32_t kb[4];
          ldsm_x4(k_lane + n2 * 16 * STRIDE + i * 32, kb);
          mma_bf16(sp[2 * n2], qf[i], kb[0], kb[1]);
          mma_bf16(sp[2 * n2 + 1], qf[i], kb[2], kb[3]);
        }
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
        part_s[(wq * (BN / 8) + n) * 32 + lane] = make_float4(sp[n][0], sp[n][1], sp[n][2], sp[n][3]);
      __syncthreads();
#pragma unroll
      for (int j = 0; j < KEYS_PER_WARP / 8; ++j) {
        const int n = wq * (KEYS_PER_WARP / 8) + j;
        float4 v = part_s[n * 32 + lane];
#pragma unroll
        for (int w = 1; w < 4; ++w) {
          const float4 u = part_s[(w * (BN / 8) + n) * 32 + lane];
          v.x += u.x;
          v.y += u.y;
          v.z += u.z;
          v.w += u.w;
        }
        s[j][0] = v.x;
        s[j][1] = v.y;
        s[j][2] = v.z;
        s[j][3] = v.w;
      }
    }
#else
    {
      // Two accumulator sets (even and odd k-steps) halve the dependent mma chain.
      float s2[KEYS_PER_WARP / 8][4];
#pragma unroll
      for (int j = 0; j < KEYS_PER_WARP / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = s2[j][e] = 0.f;
#if KEYS_PER_WARP == 16
      // x4: keys 0-7 / 8-15 (lane / 16) x dims 0-7 / 8-15 (lane / 8 % 2).
      const uint32_t k_lane = smem_addr(kv_s + (key0 + (lane & 7) + (lane >> 4) * 8) * STRIDE +
                                        ((lane >> 3) & 1) * 16);
#else
      const uint32_t k_lane =
          smem_addr(kv_s + (key0 + (lane & 7)) * STRIDE + ((lane >> 3) & 1) * 16);
#endif
#pragma unroll 3
      for (int ks = 0; ks < DQK / 16; ks += 2) {
        uint32_t a[4], a2[4];
        ldsm_x4(q_lane + ks * 32, a);
        ldsm_x4(q_lane + ks * 32 + 32, a2);
#if KEYS_PER_WARP == 16
        uint32_t kb[4], kb2[4];
        ldsm_x4(k_lane + ks * 32, kb);
        ldsm_x4(k_lane + ks * 32 + 32, kb2);
        mma_bf16(s[0], a, kb[0], kb[1]);
        mma_bf16(s[1], a, kb[2], kb[3]);
        mma_bf16(s2[0], a2, kb2[0], kb2[1]);
        mma_bf16(s2[1], a2, kb2[2], kb2[3]);
#else
        uint32_t kb[2], kb2[2];
        ldsm_x2(k_lane + ks * 32, kb);
        ldsm_x2(k_lane + ks * 32 + 32, kb2);
        mma_bf16(s[0], a, kb[0], kb[1]);
        mma_bf16(s2[0], a2, kb2[0], kb2[1]);
#endif
      }
#pragma unroll
      for (int j = 0; j < KEYS_PER_WARP / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] += s2[j][e];
    }
#endif

    // Masked, scaled scores and this warp's row maxima (rows g, g + 8).
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < KEYS_PER_WARP / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const int key = base + key0 + 8 * j + 2 * t + (e & 1);
        s[j][e] = key <= lim[h] ? s[j][e] * score_mul : -INFINITY;
        mx[h] = fmaxf(mx[h], s[j][e]);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if (t == 0) red_s[warp * 16 + g + 8 * h] = mx[h];
    }
    __syncthreads();
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m_new = m_run[h];
#pragma unroll
      for (int w = 0; w < 4; ++w) m_new = fmaxf(m_new, red_s[(rt * 4 + w) * 16 + g + 8 * h]);
      alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m_run[h] - m_new);
      m_run[h] = m_new;
      l_part[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < KEYS_PER_WARP / 8; ++j) {
      float p[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        p[e] = m_run[h] == -INFINITY ? 0.f : exp2f(s[j][e] - m_run[h]);
        l_part[h] += p[e];
      }
      const int col = (key0 + 8 * j + 2 * t) * 2;
      *reinterpret_cast<uint32_t*>(p_s + (rt * 16 + g) * PSTRIDE + col) = f2bf2(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(p_s + (rt * 16 + g + 8) * PSTRIDE + col) = f2bf2(p[2], p[3]);
    }
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }
    __syncthreads();

    // O += P V for the warp's 128 columns; V fragments by ldmatrix.trans:
    // keys 0-7 / 8-15 (lane / 8 % 2) x columns 0-7 / 8-15 (lane / 16).
    const uint32_t v_lane = smem_addr(kv_s + ((lane & 7) + ((lane >> 3) & 1) * 8) * STRIDE +
                                      (wq * 128 + (lane >> 4) * 8) * 2);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      ldsm_x4(p_lane + kk * 32, a);
#pragma unroll
      for (int nn = 0; nn < 8; ++nn) {
        uint32_t vb[4];
        ldsm_x4_trans(v_lane + kk * 16 * STRIDE + nn * 32, vb);
        mma_bf16(acc[2 * nn], a, vb[0], vb[1]);
        mma_bf16(acc[2 * nn + 1], a, vb[2], vb[3]);
      }
    }
    __syncthreads();  // the tile, P and the maxima are rewritten next iteration
#if LOAD == 1
    if (tile + 1 < t_end) store();
#endif
  }

  // Row sums: the quad's, then the group's warps.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_part[h] += __shfl_xor_sync(0xffffffffu, l_part[h], 1);
    l_part[h] += __shfl_xor_sync(0xffffffffu, l_part[h], 2);
    if (t == 0) red_s[warp * 16 + g + 8 * h] = l_part[h];
  }
  __syncthreads();
#if CLUSTER > 0
  cluster_merge(acc, m_run, red_s, reinterpret_cast<float*>(raw_s), kv_mul, rows, g, t, wq,
                splits, part, qo_indptr[gridDim.y] * heads, (size_t)q0 * heads + f0,
                b * gridDim.z + blockIdx.z, out + ((size_t)q0 * heads + f0) * DV);
  return;
#endif
  const int total_rows = qo_indptr[gridDim.y] * heads;
  const size_t row0 = (size_t)q0 * heads + f0 + rt * 16;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (rt * 16 + r >= rows) continue;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) l += red_s[(rt * 4 + w) * 16 + r];
    const float inv = l > 0.f ? kv_mul / l : 0.f;
    const size_t row = row0 + r;
    if (splits == 1) {
      __nv_bfloat16* o = out + row * DV;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int pos = wq * 128 + 8 * n + 2 * t;
#if KV_FORMAT == 2
        o[column_of(pos)] = __float2bfloat16_rn(acc[n][2 * h] * inv);
        o[column_of(pos + 1)] = __float2bfloat16_rn(acc[n][2 * h + 1] * inv);
#else
        reinterpret_cast<uint32_t*>(o)[pos / 2] =
            f2bf2(acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
#endif
      }
    } else {
      float* o = part + (row * splits + split) * DV;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int pos = wq * 128 + 8 * n + 2 * t;
#if KV_FORMAT == 2
        o[column_of(pos)] = acc[n][2 * h] * inv;
        o[column_of(pos + 1)] = acc[n][2 * h + 1] * inv;
#else
        reinterpret_cast<float2*>(o)[pos / 2] =
            make_float2(acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
#endif
      }
      if (wq == 0 && t == 0)
        part[(size_t)total_rows * splits * DV + row * splits + split] =
            l > 0.f ? m_run[h] + log2f(l) : -INFINITY;
    }
  }
  if (splits == 1 || !merge) return;

  // merge == 1: the last block of this (sequence, row block) to finish combines its rows,
  // so the call is one launch. Partials are published by a fence before the count; the
  // counter (after the log-sum-exps, zero from allocation) is reset by the block that
  // merges, ready for the next call or graph replay.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* count = reinterpret_cast<int*>(part + (size_t)total_rows * splits * (DV + 1)) +
                 b * gridDim.z + blockIdx.z;
    merges_here = atomicAdd(count, 1) == splits - 1;
    if (merges_here) *count = 0;
  }
  __syncthreads();
  if (!merges_here) return;
  __threadfence();
  for (int i = threadIdx.x; i < rows * (DV / 4); i += NT) {
    const size_t row = (size_t)q0 * heads + f0 + i / (DV / 4);
    reinterpret_cast<uint2*>(out + row * DV)[i % (DV / 4)] =
        merged_cols(part, splits, total_rows, row, i % (DV / 4));
  }
}
