"""Helpers shared by the vendor-library families (FlashInfer, aiter).

Page tables. The task hands the cache as one `(total_kv, 1, 576)` buffer, sequence b at rows
`[kv_indptr[b], kv_indptr[b+1])`. FlashInfer and aiter read KV through a page table instead.
Viewing the buffer as `(total_kv / p, p, ...)` pages costs nothing exactly when every
sequence starts on a page boundary, i.e. when every kv length is a multiple of `p`; then
sequence b owns a run of consecutive pages. Other page sizes would need a copy of the whole
cache on every call (which would be timed), so they are refused with a reason instead.
Page size 1 fits any lengths, ragged or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mla_tune.problem.shapes import QK_HEAD_DIM, Shape, TaskInput


@dataclass(frozen=True)
class PageTable:
    """CSR page table of a contiguous cache viewed as `num_pages` pages of `page_size` rows.

    All tensors are int32 on the CPU; backends move them to the device once, at build."""

    page_size: int
    num_pages: int
    kv_indptr: torch.Tensor
    """(batch+1,) prefix sums of pages per sequence."""
    kv_indices: torch.Tensor
    """(num_pages,) page ids; sequence b's pages are `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`."""
    last_page_len: torch.Tensor
    """(batch,) tokens used in each sequence's last page, in 1..page_size."""
    kv_lens: torch.Tensor
    """(batch,) tokens per sequence."""


def page_layout_problem(kv_lens: Sequence[int], page_size: int) -> str | None:
    """None if the contiguous cache can be viewed as pages of `page_size` without a copy,
    else why not."""
    if page_size < 1:
        return f"page size must be >= 1, got {page_size}"
    for b, n in enumerate(kv_lens):
        if n % page_size:
            return (f"kv length {n} of sequence {b} is not a multiple of page size {page_size}: "
                    "the contiguous cache cannot be paged without copying it every call")
    return None


def contiguous_page_table(kv_lens: Sequence[int], page_size: int) -> PageTable:
    """The page table that reads sequence b's rows of the contiguous cache in order."""
    problem = page_layout_problem(kv_lens, page_size)
    if problem:
        raise ValueError(problem)
    lens = torch.tensor(list(kv_lens), dtype=torch.int64)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(pages, 0)])
    num_pages = int(indptr[-1])
    return PageTable(
        page_size=page_size,
        num_pages=num_pages,
        kv_indptr=indptr.to(torch.int32),
        kv_indices=torch.arange(num_pages, dtype=torch.int32),
        last_page_len=(lens - (pages - 1) * page_size).to(torch.int32),
        kv_lens=lens.to(torch.int32),
    )


def warmup_input(shape: Shape, kv_dtype: torch.dtype, device: torch.device) -> TaskInput:
    """Zero inputs of the shape's sizes holding only the KV entry (`bf16`, or `fp8` with a
    unit scale) a variant reads, so the warm-up call at build takes the timed path."""
    q = torch.zeros((shape.total_q, shape.heads, QK_HEAD_DIM), dtype=torch.bfloat16,
                    device=device)
    kv = torch.zeros((shape.total_kv, 1, QK_HEAD_DIM), dtype=kv_dtype, device=device)
    if kv_dtype == torch.bfloat16:
        kv_data: dict[str, Any] = {"bf16": kv}
    else:
        kv_data = {"fp8": (kv, torch.ones(1, dtype=torch.float32, device=device))}
    qo = torch.arange(0, shape.total_q + 1, shape.q_len, dtype=torch.int32, device=device)
    kv_indptr = torch.cumsum(torch.tensor((0,) + shape.kv_lens), 0).to(torch.int32).to(device)
    return q, kv_data, qo, kv_indptr, shape.task_config()
