// Pieces the CUDA MLA decode kernels share: the split-KV scratch layout and its merge
// kernel, the warp-level mma and ldmatrix wrappers, cp.async, and the bit-level decoders
// of e4m3 and e2m1 into bf16x2. A kernel file includes this header and lists it among its
// family file's sources (so a change here re-keys that family's stored results).
//
// Scratch of a split launch (SPLITS > 1): float32 partial outputs, DV values per
// (row, split), row-major by row then split, followed by one log-sum-exp (log2 domain,
// -inf for a split with no keys) per (row, split).

#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#define DQK 576
#define DV 512

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col), bf16 inputs, float32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t f2bf2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t bf2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a),
                             *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

// Bytes 1 and 3 of x, two e4m3 values, -> bf16x2 (bytes 0 and 2 are ignored), by bits:
// the e4m3 exponent and mantissa land in the low bits of the bf16 exponent and the top
// of its mantissa, then x 2^120 restores the bias (e4m3 subnormals become bf16
// subnormals: exact).
__device__ __forceinline__ uint32_t e4m3_odd_bytes_to_bf16x2(uint32_t x) {
  return bf2_mul((x & 0x80008000u) | ((x >> 4) & 0x07f007f0u), 0x7b807b80u);
}

// Elements k and k + 4 of a word of eight e2m1 (element j in bits 4j..4j+3) -> bf16x2 in
// units of 2^-126: signs to bits 15 / 31, exponent and mantissa to bits 6..8 / 22..24.
template <int K>
__device__ __forceinline__ uint32_t e2m1_pair_bits(uint32_t w) {
  const uint32_t sign = (w << (12 - 4 * K)) & 0x80008000u;
  const uint32_t mag = (K < 2 ? w << (6 - 4 * K) : w >> (4 * K - 6)) & 0x01c001c0u;
  return sign | mag;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

// Columns 4 c4 .. 4 c4 + 3 of output row `row`, its splits combined by log-sum-exp.
__device__ __forceinline__ uint2 merged_cols(const float* part, int splits, int total_rows,
                                             size_t row, int c4) {
  const float* lse = part + (size_t)total_rows * splits * DV + row * splits;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, __ldcg(lse + s));
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float l = __ldcg(lse + s);
    const float w = l == -INFINITY ? 0.f : exp2f(l - mx);
    if (w == 0.f) continue;
    const float4 v =
        __ldcg(reinterpret_cast<const float4*>(part + (row * splits + s) * DV) + c4);
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
    wsum += w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  return make_uint2(f2bf2(acc.x * inv, acc.y * inv), f2bf2(acc.z * inv, acc.w * inv));
}

// The merge launch: one block of 128 threads per output row; thread t owns columns
// 4t..4t+3.
extern "C" __global__ void __launch_bounds__(128)
mla_merge(const float* __restrict__ part, __nv_bfloat16* __restrict__ out, int splits,
          int total_rows) {
  reinterpret_cast<uint2*>(out + (size_t)blockIdx.x * DV)[threadIdx.x] =
      merged_cols(part, splits, total_rows, blockIdx.x, threadIdx.x);
}
