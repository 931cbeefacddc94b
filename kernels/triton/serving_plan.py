"""The planning step of a paged decode call as one small Triton kernel.

A paged call's metadata, as servers hold it (FlashInfer's layout), is a page indptr, the
page indices and the lengths in tokens. The decode kernel (mla_decode.py) reads instead
the cumulative token counts, the first cache row of each page, and the page indptr. This
kernel writes all three (and a copy of the query indptr) into fixed buffers in one launch, on the device: no host sync,
no allocation (a `torch.cumsum` allocates its scan's scratch on every call), and one
launch instead of four.

Grid: cdiv(number of pages, BLOCK) programs each scale a block of page indices; program 0
also scans the lengths and copies the page indptr.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
BATCH_BLOCK = 256


@triton.jit(do_not_specialize=["batch", "nnz", "page_size"])
def serving_plan_kernel(LENS, PAGE_IDX, PAGE_PTR, QO, TOK, ROWS, PAGE_PTR_OUT, QO_OUT, batch,
                        nnz, page_size, BLOCK: tl.constexpr, BATCH_BLOCK: tl.constexpr):
    """TOK[0] = 0, TOK[b + 1] = sum(LENS[:b + 1]); ROWS[i] = PAGE_IDX[i] * page_size;
    PAGE_PTR_OUT = PAGE_PTR and QO_OUT = QO (batch + 1 entries each)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < nnz
    idx = tl.load(PAGE_IDX + offs, mask=ok, other=0)
    tl.store(ROWS + offs, (idx * page_size).to(tl.int32), mask=ok)
    if pid == 0:
        carry = tl.zeros([1], tl.int32)
        b0 = 0
        while b0 < batch:  # a while loop: the interpreter cannot range() over this bound
            ob = b0 + tl.arange(0, BATCH_BLOCK)
            okb = ob < batch
            lens = tl.load(LENS + ob, mask=okb, other=0).to(tl.int32)
            tl.store(TOK + 1 + ob, tl.cumsum(lens, 0) + carry, mask=okb)
            carry += tl.sum(lens, 0)
            tl.store(PAGE_PTR_OUT + ob, tl.load(PAGE_PTR + ob, mask=okb, other=0).to(tl.int32),
                     mask=okb)
            tl.store(QO_OUT + ob, tl.load(QO + ob, mask=okb, other=0).to(tl.int32), mask=okb)
            b0 += BATCH_BLOCK
        one = tl.arange(0, 1)
        tl.store(TOK + one, tl.zeros([1], tl.int32))
        tl.store(PAGE_PTR_OUT + batch + one, tl.load(PAGE_PTR + batch + one).to(tl.int32))
        tl.store(QO_OUT + batch + one, tl.load(QO + batch + one).to(tl.int32))


class ServingPlanLauncher:
    """The planning kernel compiled once per input dtypes and launched through its raw
    launcher (Triton's Python launch path costs tens of microseconds of host time).
    Inputs must be contiguous and 16-byte aligned, as compiled (`aligned`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.interpret = device.type != "cuda"
        self._compiled: dict[tuple[torch.dtype, ...], tuple] = {}

    @staticmethod
    def aligned(*ts: torch.Tensor) -> bool:
        return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in ts)

    def __call__(self, lens: torch.Tensor, page_idx: torch.Tensor, page_ptr: torch.Tensor,
                 qo: torch.Tensor, tok: torch.Tensor, rows: torch.Tensor,
                 page_ptr_out: torch.Tensor, qo_out: torch.Tensor, page_size: int) -> None:
        """Write `tok`, `rows[:nnz]`, `page_ptr_out` and `qo_out` (int32) from the call's
        metadata, all in buffers the decode kernel's launch (or CUDA graph) reads."""
        batch, nnz = page_ptr.numel() - 1, page_idx.numel()
        grid = (triton.cdiv(max(nnz, 1), BLOCK), 1, 1)
        args = (lens, page_idx, page_ptr, qo, tok, rows, page_ptr_out, qo_out, batch, nnz,
                page_size)
        if self.interpret:
            serving_plan_kernel[grid](*args, BLOCK=BLOCK, BATCH_BLOCK=BATCH_BLOCK)
            return
        key = (lens.dtype, page_idx.dtype, page_ptr.dtype, qo.dtype)
        k = self._compiled.get(key)
        if k is None:
            from triton.runtime import driver

            c = serving_plan_kernel.warmup(*args, grid=grid, BLOCK=BLOCK,
                                           BATCH_BLOCK=BATCH_BLOCK, num_warps=4)
            c.run  # noqa: B018 - loads the module and creates the launcher
            k = self._compiled[key] = (c.run, c.function, c.packed_metadata,
                                       driver.active.get_current_stream,
                                       driver.active.get_current_device())
        run, fn, md, stream, dev = k
        run(grid[0], 1, 1, stream(dev), fn, md, None, None, None, *args, BLOCK, BATCH_BLOCK)
