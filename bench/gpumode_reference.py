"""Stand-in `reference.py` for the GPU MODE mixed-mla task (problems/amd_202602) on NVIDIA.

The task's own reference times and checks against aiter's a8w8 MLA decode, which runs on
AMD GPUs only. This module gives the harness (eval.py, utils.py, task.py of that task) the
same two entry points without aiter:
- `generate_input(batchsize, qseqlen, kvseqlen, seed)`: the task's inputs, drawn the same
  way (one CUDA generator seeded with `seed`; q then the bf16 cache drawn as bfloat16
  normals; the fp8 cache by dynamic per-tensor scaling computed in bfloat16, as the task
  does; the MXFP4 cache in aiter's layout: E2M1 pairs and E8M0 block scales padded to a
  multiple of 256 rows and 8 blocks; uniform indptrs);
- `check_implementation(data, output)`: the task's math, which its reference computes with
  fp8 Q (per-tensor, like the cache) and the fp8 cache: here in float32 PyTorch on the
  dequantized values, compared by the harness's `make_match_reference` at the task's
  tolerances (rtol = atol = 0.1).
It imports no mla_tune (it runs where mla-tune is not installed). bench/gpumode_harness.sh
runs the harness with it.
"""

import torch
from utils import make_match_reference

NUM_HEADS, NUM_KV_HEADS = 16, 1
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
V_HEAD_DIM = KV_LORA_RANK
SM_SCALE = 1.0 / QK_HEAD_DIM ** 0.5
FP8 = torch.float8_e4m3fn
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def per_tensor_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 values and the float32 (1,) scale, the scale computed in x's dtype."""
    fmax = torch.finfo(FP8).max
    scale = x.abs().amax().clamp(min=1e-12) / fmax
    return (x / scale).clamp(-fmax, fmax).to(FP8), scale.to(torch.float32).reshape(1)


def mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of (N, 1, 576) bf16 rows: packed E2M1 (element 2i in the low nibble) and the
    E8M0 scales (rounded-up block amax exponent minus 2; ties away from zero)."""
    rows, d = x.shape[0] * x.shape[1], x.shape[-1]
    blocks = d // 32
    codes_out = torch.empty((rows, d // 2), dtype=torch.uint8, device=x.device)
    scale = torch.zeros((-(-rows // 256) * 256, -(-blocks // 8) * 8), dtype=torch.uint8,
                        device=x.device)
    mid = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    flat = x.reshape(rows, d)
    step = 1 << 20
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        b = flat[r0:r1].float().view(r1 - r0, blocks, 32)
        bits = b.abs().amax(-1).view(torch.int32)
        e = ((((bits + 0x200000) & -0x800000) >> 23) & 0xFF) - 129
        e = e.clamp(-127, 127)
        scale[r0:r1, :blocks] = (e + 127).to(torch.uint8)
        q = b * torch.exp2(-e.float()).unsqueeze(-1)
        code = torch.bucketize(q.abs(), mid, right=True).to(torch.uint8)
        code |= torch.signbit(q).to(torch.uint8) << 3
        code = code.view(r1 - r0, d)
        codes_out[r0:r1] = code[:, 0::2] | (code[:, 1::2] << 4)
    fp4 = codes_out.view(x.shape[0], x.shape[1], d // 2)
    if hasattr(torch, "float4_e2m1fn_x2"):
        fp4 = fp4.view(torch.float4_e2m1fn_x2)
    if hasattr(torch, "float8_e8m0fnu"):
        scale = scale.view(torch.float8_e8m0fnu)
    return fp4, scale


def generate_input(batchsize: int, qseqlen: int, kvseqlen: int, seed: int) -> tuple:
    """The task tuple `(q, kv_data, qo_indptr, kv_indptr, config)` for one test spec."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    q = torch.randn((batchsize * qseqlen, NUM_HEADS, QK_HEAD_DIM), dtype=torch.bfloat16,
                    device="cuda", generator=gen)
    kv = torch.randn((batchsize * kvseqlen, NUM_KV_HEADS, QK_HEAD_DIM), dtype=torch.bfloat16,
                     device="cuda", generator=gen)
    kv_data = {"bf16": kv, "fp8": per_tensor_fp8(kv), "mxfp4": mxfp4(kv)}
    steps = torch.arange(0, batchsize + 1, dtype=torch.int32, device="cuda")
    config = {"batch_size": batchsize, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS,
              "qk_head_dim": QK_HEAD_DIM, "kv_lora_rank": KV_LORA_RANK,
              "qk_rope_head_dim": QK_ROPE_HEAD_DIM, "v_head_dim": V_HEAD_DIM,
              "q_seq_len": qseqlen, "kv_seq_len": kvseqlen, "sm_scale": SM_SCALE}
    return q, kv_data, steps * qseqlen, steps * kvseqlen, config


def ref_kernel(data: tuple) -> torch.Tensor:
    """Attention of fp8 Q on the fp8 cache, in float32 on their dequantized values."""
    q, kv_data, qo, kvp, config = data
    q8, q_scale = per_tensor_fp8(q)
    kv8, kv_scale = kv_data["fp8"]
    qf = q8.float() * q_scale
    kv = kv8.float().reshape(kv8.shape[0], QK_HEAD_DIM) * kv_scale
    out = torch.empty((q.shape[0], q.shape[1], V_HEAD_DIM), dtype=torch.bfloat16,
                      device=q.device)
    qo_h, kv_h = qo.tolist(), kvp.tolist()
    for b in range(len(qo_h) - 1):
        q0, q1, k0, k1 = qo_h[b], qo_h[b + 1], kv_h[b], kv_h[b + 1]
        keys, ql, n = kv[k0:k1], q1 - q0, k1 - k0
        s = torch.einsum("qhd,kd->qhk", qf[q0:q1], keys) * config["sm_scale"]
        j = torch.arange(ql, device=q.device).view(ql, 1, 1)
        k = torch.arange(n, device=q.device).view(1, 1, n)
        p = torch.softmax(s.masked_fill(k > n - ql + j, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("qhk,kd->qhd", p, keys[:, :V_HEAD_DIM]).to(torch.bfloat16)
    return out


check_implementation = make_match_reference(ref_kernel, rtol=1e-01, atol=1e-01)
