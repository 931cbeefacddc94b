// A user's MLA decode kernel, tuned by mla-tune as a compiled-source family
// (my_mla.toml next to it). bf16 KV only, one block per (query token, head): warp w takes
// keys w, w + NW, ... with its own online softmax; the warps are merged at the end.
// Macro knob: NW (warps per block). No torch headers: nvcc -cubin -arch=sm_90a -DNW=4.
#include <cuda_bf16.h>
#include <stdint.h>

#ifndef NW
#error "define NW (warps per block)"
#endif
#define DQK 576
#define DV 512

extern "C" __global__ void my_mla(const __nv_bfloat16* q, const __nv_bfloat16* kv,
                                  const int* qo_indptr, const int* kv_indptr,
                                  __nv_bfloat16* out, int batch, float sm_scale) {
  __shared__ float m_w[NW], l_w[NW], o_w[NW][DV];
  const int head = blockIdx.x, heads = gridDim.x, tok = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int b = 0;
  while (b + 1 < batch && qo_indptr[b + 1] <= tok) ++b;
  const int ql = qo_indptr[b + 1] - qo_indptr[b], t = tok - qo_indptr[b];
  const int k0 = kv_indptr[b], L = kv_indptr[b + 1] - k0;
  const int last = L - ql + t;  // causal: keys [0, L - ql + t]
  const __nv_bfloat16* qr = q + ((size_t)tok * heads + head) * DQK;
  float qf[DQK / 32];
  for (int i = 0; i < DQK / 32; ++i) qf[i] = __bfloat162float(qr[lane + 32 * i]);
  float m = -INFINITY, l = 0.f, acc[DV / 32];
  for (int i = 0; i < DV / 32; ++i) acc[i] = 0.f;
  for (int n = warp; n <= last; n += NW) {
    const __nv_bfloat16* kr = kv + (size_t)(k0 + n) * DQK;
    float s = 0.f;
    for (int i = 0; i < DQK / 32; ++i) s += qf[i] * __bfloat162float(kr[lane + 32 * i]);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    s *= sm_scale;
    const float m_new = fmaxf(m, s), alpha = __expf(m - m_new), p = __expf(s - m_new);
    l = l * alpha + p;
    for (int i = 0; i < DV / 32; ++i)
      acc[i] = acc[i] * alpha + p * __bfloat162float(kr[lane + 32 * i]);
    m = m_new;
  }
  if (lane == 0) { m_w[warp] = m; l_w[warp] = l; }
  for (int i = 0; i < DV / 32; ++i) o_w[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float mx = -INFINITY;
  for (int w = 0; w < NW; ++w) mx = fmaxf(mx, m_w[w]);
  for (int d = threadIdx.x; d < DV; d += 32 * NW) {
    float num = 0.f, den = 0.f;
    for (int w = 0; w < NW; ++w) {
      const float f = m_w[w] == -INFINITY ? 0.f : __expf(m_w[w] - mx);
      num += f * o_w[w][d];
      den += f * l_w[w];
    }
    out[((size_t)tok * heads + head) * DV + d] = __float2bfloat16(num / den);
  }
}
