"""The checks of a paged call's inputs: the page table, on the host, and the KV pool.

`MLADecodeWrapper` (mla_tune/runtime/wrapper.py) runs these before any launch, so a bad
table or pool is a ValueError that says what is wrong, never an illegal memory access: the
table's pointers rise from 0 to the number of indices, every length is at least q_len and
within its pages, every page a length uses is >= 0 (and, at `run`, inside the pool); the
pool has the format's dtype and width, the wrapper's page size, and lies on its device.
"""

from __future__ import annotations

from typing import Any

import torch

from mla_tune.problem.shapes import QK_HEAD_DIM, KVFormat

_FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz})
_U8 = frozenset({torch.uint8} | ({torch.float4_e2m1fn_x2}
                                 if hasattr(torch, "float4_e2m1fn_x2") else set()))
_E8M0 = frozenset({torch.uint8} | ({torch.float8_e8m0fnu}
                                   if hasattr(torch, "float8_e8m0fnu") else set()))


def check_page_table(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, kv_lens: torch.Tensor, q_len: int, page: int
                     ) -> tuple[int, int]:
    """Check a page table on the host; (largest used page index, longest length)."""
    qo, ptr = qo_indptr.cpu().long(), kv_indptr.cpu().long()
    idx, lens = kv_indices.cpu().long(), kv_lens.cpu().long()
    batch = ptr.numel() - 1
    if not torch.equal(qo, torch.arange(batch + 1) * q_len):
        raise ValueError(f"qo_indptr must be arange(batch + 1) * q_len (q_len {q_len}); got "
                         f"{qo[:8].tolist()}...")
    if int(ptr[0]) != 0 or bool((ptr[1:] < ptr[:-1]).any()) or int(ptr[-1]) != idx.numel():
        raise ValueError(f"kv_indptr must rise from 0 to len(kv_indices) = {idx.numel()}; "
                         f"got {ptr[:8].tolist()}... ending at {int(ptr[-1])}")
    pages = ptr[1:] - ptr[:-1]
    short = (lens < q_len).nonzero()
    if short.numel():
        b = int(short[0])
        raise ValueError(f"sequence {b}: kv length {int(lens[b])} < q_len {q_len}")
    over = (lens > pages * page).nonzero()
    if over.numel():
        b = int(over[0])
        raise ValueError(f"sequence {b}: kv length {int(lens[b])} is beyond its "
                         f"{int(pages[b])} page(s) of {page} tokens")
    # Pages a sequence's length uses; entries past them are never read.
    used_n = (lens + page - 1) // page
    pos = torch.arange(idx.numel()) - torch.repeat_interleave(ptr[:-1], pages)
    used = pos < torch.repeat_interleave(used_n, pages)
    u = idx[used]
    if u.numel() and int(u.min()) < 0:
        raise ValueError(f"kv_indices holds page {int(u.min())}: page indices must be >= 0")
    return (int(u.max()) if u.numel() else -1), int(lens.max())


def check_pool(kv_cache: Any, fmt: KVFormat, page: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Check a pool of `fmt` and page size `page` on `device` as `run` takes it (the
    wrapper's docstring); (values, fp8 scale, MXFP4 scales)."""
    if fmt is KVFormat.BF16:
        kv, scale, sc = kv_cache, None, None
        dtypes, width = {torch.bfloat16}, QK_HEAD_DIM
    else:
        if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
            raise ValueError(f"a {fmt.value} kv_cache is a (values, scale) pair")
        kv = kv_cache[0]
        scale, sc = (kv_cache[1], None) if fmt is KVFormat.FP8 else (None, kv_cache[1])
        dtypes, width = (_FP8, QK_HEAD_DIM) if fmt is KVFormat.FP8 else \
            (_U8, QK_HEAD_DIM // 2)
    if not isinstance(kv, torch.Tensor) or kv.dtype not in dtypes or kv.dim() != 3 \
            or kv.shape[1] != page or kv.shape[2] != width or not kv.is_contiguous() \
            or kv.device != device:
        got = (f"{kv.dtype} {tuple(kv.shape)} on {kv.device}"
               if isinstance(kv, torch.Tensor) else type(kv).__name__)
        raise ValueError(f"the {fmt.value} pool must be a contiguous "
                         f"(num_pages, {page}, {width}) tensor of "
                         f"{'/'.join(sorted(map(str, dtypes)))} on {device}; got {got}")
    pages = kv.shape[0]
    if fmt is KVFormat.FP8:
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 \
                or scale.numel() != 1 or scale.device != device:
            raise ValueError(f"the fp8 scale must be a (1,) float32 tensor on {device}")
    elif fmt is KVFormat.MXFP4:
        if not isinstance(sc, torch.Tensor) or sc.dtype not in _E8M0 or sc.dim() != 2 \
                or sc.shape[0] < pages * page or sc.shape[1] < QK_HEAD_DIM // 32 \
                or sc.stride(1) != 1 or sc.device != device:
            raise ValueError(f"the MXFP4 scales must be a ({pages * page}, >= 18) uint8 "
                             f"tensor (one row per token slot, rows contiguous) on "
                             f"{device}")
        if kv.dtype != torch.uint8:
            kv = kv.view(torch.uint8)
        if sc.dtype != torch.uint8:
            sc = sc.view(torch.uint8)
    return kv, scale, sc


def unpack_pool(fmt: KVFormat, kv_cache: Any
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The pool's parts unchecked (`check_inputs=False`)."""
    if fmt is KVFormat.BF16:
        return kv_cache, None, None
    if fmt is KVFormat.FP8:
        return kv_cache[0], kv_cache[1], None
    kv, sc = kv_cache
    return (kv if kv.dtype == torch.uint8 else kv.view(torch.uint8)), None, \
        (sc if sc.dtype == torch.uint8 else sc.view(torch.uint8))


__all__ = ["check_page_table", "check_pool", "unpack_pool"]
