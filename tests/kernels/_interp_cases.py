"""Interpreter correctness cases for the Triton family, run in a child process with
TRITON_INTERPRET=1 (the env var must be set before Triton kernels are defined, and other
tests in the same pytest process must keep compiled kernels). Prints one JSON per case."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mla_tune.kernels.triton.mla_decode import KernelConfig, MlaDecodeLauncher  # noqa: E402
from mla_tune.problem.reference import mla_decode_reference  # noqa: E402
from mla_tune.problem.shapes import Shape, generate_input  # noqa: E402

# name: (shape kwargs, kernel config kwargs)
CASES: dict[str, tuple[dict, dict]] = {
    "bf16_ragged_1split": (dict(kv_lens=(37, 128, 5)), dict(num_splits=1)),
    "bf16_ragged_3split_merge": (dict(kv_lens=(37, 128, 5)), dict(num_splits=3)),
    "bf16_ragged_3split_fused": (dict(kv_lens=(37, 128, 5)), dict(num_splits=3, fast_mode=True)),
    # 19 active splits in the long sequence: the second-launch merge takes 16 per load.
    "bf16_19split_merge": (dict(kv_lens=(600, 40)), dict(num_splits=19)),
    "bf16_q4_causal_h32_bm64": (dict(kv_lens=(70, 9), q_len=4, heads=32),
                                dict(block_m=64, num_warps=8, num_splits=2, fast_mode=True)),
    "bf16_q4_causal_h16_bm16": (dict(kv_lens=(64, 23), q_len=4), dict(num_splits=2)),
    "bf16_page16": (dict(kv_lens=(50, 100), q_len=2), dict(page_size=16, num_splits=2)),
    "bf16_shuffled_pages1": (dict(kv_lens=(40, 33)), dict(page_size=1, num_splits=2)),
    "bf16_shuffled_pages16": (dict(kv_lens=(64, 45, 80)), dict(page_size=16, num_splits=2)),
    "fp8_bf16": (dict(kv_lens=(60, 128), fmt="fp8"), dict(compute="bf16", num_splits=2)),
    "fp8_fp16_fused": (dict(kv_lens=(60, 128), fmt="fp8"),
                       dict(compute="fp16", num_splits=4, fast_mode=True)),
    "fp8_fp16_operand": (dict(kv_lens=(60, 128), fmt="fp8"),
                         dict(compute="fp16", num_splits=2, fp8_convert="operand")),
    "fp8_fp8": (dict(kv_lens=(60, 128), fmt="fp8"), dict(compute="fp8", num_splits=2)),
    "fp8_fp8qk_fused_q4": (dict(kv_lens=(60, 31), q_len=4, fmt="fp8"),
                           dict(compute="fp8qk", num_splits=2, fast_mode=True)),
    "fp8_fp8_fast_q4": (dict(kv_lens=(60, 31), q_len=4, fmt="fp8"),
                        dict(compute="fp8", num_splits=2, fast_mode=True)),
    # TMA loads end at the split's end: the cache is followed by NaN rows here, which a
    # tile read past the last sequence's end would carry into the output.
    "bf16_tma_ragged_nan_tail": (dict(kv_lens=(37, 128, 5), nan_tail=True),
                                 dict(num_splits=3, kv_load="tma")),
    "bf16_tma_q4_fused_nan_tail": (dict(kv_lens=(64, 23), q_len=4, nan_tail=True),
                                   dict(num_splits=2, fast_mode=True, kv_load="tma")),
    "fp8_fp8qk_tma_nan_tail": (dict(kv_lens=(60, 31), fmt="fp8", nan_tail=True),
                               dict(compute="fp8qk", num_splits=2, kv_load="tma")),
    "fp8_fp8_tma_1split_nan_tail": (dict(kv_lens=(60, 31), fmt="fp8", nan_tail=True),
                                    dict(compute="fp8", num_splits=1, kv_load="tma")),
    "fp8_fp16_tma_operand_nan_tail": (dict(kv_lens=(60, 31), fmt="fp8", nan_tail=True),
                                      dict(compute="fp16", num_splits=1, kv_load="tma",
                                           fp8_convert="operand")),
    # Whole tiles and one query per sequence: one pair of host-made descriptors over the
    # whole cache serves every program, NaN rows after it included.
    "bf16_tma_host_nan_tail": (dict(kv_lens=(128, 64, 192), nan_tail=True),
                               dict(num_splits=3, block_n=32, kv_load="tma_host")),
    "fp8_fp8_tma_host_nan_tail": (dict(kv_lens=(128, 64), fmt="fp8", nan_tail=True),
                                  dict(compute="fp8", num_splits=2, kv_load="tma_host")),
    "mxfp4_h32": (dict(kv_lens=(77, 128), heads=32, fmt="mxfp4"), dict(num_splits=2)),
    "mxfp4_q4_fused_page16": (dict(kv_lens=(90, 40), q_len=4, fmt="mxfp4"),
                              dict(num_splits=3, fast_mode=True, page_size=16)),
}


def _shuffled_pages(kv: torch.Tensor, kv_lens: list[int], page: int
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Copy the contiguous cache into pages placed in reverse order (plus a spare page), and
    the page table pointing at them: a real non-identity paged layout."""
    pages, indptr = [], [0]
    start = 0
    for L in kv_lens:
        for k in range(-(-L // page)):
            rows = kv[start + k * page: start + min(L, (k + 1) * page)]
            pad = torch.zeros((page - rows.shape[0],) + rows.shape[1:], dtype=kv.dtype)
            pages.append(torch.cat([rows, pad]))
        start += L
        indptr.append(len(pages))
    n = len(pages)
    order = list(reversed(range(n)))  # logical page i lives in physical slot order[i] + 1
    phys = torch.zeros(((n + 1) * page,) + kv.shape[1:], dtype=kv.dtype)
    for i, pg in enumerate(pages):
        phys[(order[i] + 1) * page:(order[i] + 2) * page] = pg
    table = torch.tensor([(order[i] + 1) * page for i in range(n)], dtype=torch.int32)
    return phys, (table, torch.tensor(indptr, dtype=torch.int32))


def run_case(name: str) -> dict:
    shape_kw, cfg_kw = CASES[name]
    shape_kw = dict(shape_kw)
    fmt = shape_kw.pop("fmt", "bf16")
    kv_lens = shape_kw.pop("kv_lens")
    nan_tail = shape_kw.pop("nan_tail", False)
    shape = Shape(batch=len(kv_lens), kv_lens=kv_lens, kv_format=fmt, **shape_kw)
    data = generate_input(shape, seed=7)
    q, kv_data, qo, kvp, config = data
    ref = mla_decode_reference(q, kv_data, qo, kvp, config, kv_format=fmt)
    cfg = KernelConfig(kv_format=fmt, **cfg_kw)
    page_table = None
    kv, scale, sc = {"bf16": (kv_data["bf16"], None, None),
                     "fp8": (kv_data["fp8"][0], kv_data["fp8"][1], None),
                     "mxfp4": (kv_data["mxfp4"][0], None, kv_data["mxfp4"][1])}[fmt]
    if name.startswith("bf16_shuffled"):
        kv, page_table = _shuffled_pages(kv, list(kv_lens), cfg.page_size)
    if nan_tail:
        tail = torch.full((64,) + kv.shape[1:], float("nan")).to(kv.dtype)
        kv = torch.cat([kv, tail])
    launcher = MlaDecodeLauncher(cfg, heads=shape.heads, q_len=shape.q_len,
                                 kv_lens=list(kv_lens), device="cpu", page_table=page_table)
    out = launcher(q, kv, scale, sc, qo, kvp).float()
    err = (out - ref).abs()
    return {"name": name, "max_abs_err": float(err.max()),
            "mismatch_1e-2": float((err > 1e-2 + 1e-2 * ref.abs()).float().mean()),
            "shape": list(out.shape), "ref_shape": list(ref.shape),
            "finite": bool(torch.isfinite(out).all()), "tma": launcher.constexprs["TMA"]}


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1: the kernels must be defined for the interpreter")
    for case in sys.argv[1:] or list(CASES):
        print(json.dumps(run_case(case)), flush=True)
