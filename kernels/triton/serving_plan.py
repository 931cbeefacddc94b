"""A paged call's metadata copied into fixed buffers in one small Triton launch.

The balanced decode kernels (mla_decode.py, SCHED_PAGED) read FlashInfer's paged metadata
as a server holds it: lengths, page indptr, page indices and the query indptr, int32. A
wrapper whose runs must read the same addresses at every step (a CUDA graph captured once
per bucket and replayed after later plans that bring other tensors) copies each plan's
metadata into its own buffers: this kernel does all four copies (and any int64 -> int32
conversion) in one launch, on the device, without a host sync or an allocation (four
`copy_` calls would be four launches).

Grid: cdiv(number of pages, BLOCK) programs each copy a block of page indices; program 0
also copies the lengths and both indptrs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
BATCH_BLOCK = 256


@triton.jit(do_not_specialize=["batch", "nnz"])
def serving_plan_kernel(LENS, PAGE_IDX, PAGE_PTR, QO, LENS_OUT, IDX_OUT, PAGE_PTR_OUT, QO_OUT,
                        batch, nnz, BLOCK: tl.constexpr, BATCH_BLOCK: tl.constexpr):
    """IDX_OUT[:nnz] = PAGE_IDX; LENS_OUT = LENS (batch entries); PAGE_PTR_OUT = PAGE_PTR
    and QO_OUT = QO (batch + 1 entries each); all int32."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < nnz
    tl.store(IDX_OUT + offs, tl.load(PAGE_IDX + offs, mask=ok, other=0).to(tl.int32), mask=ok)
    if pid == 0:
        b0 = 0
        while b0 < batch + 1:  # a while loop: the interpreter cannot range() over this bound
            ob = b0 + tl.arange(0, BATCH_BLOCK)
            okb = ob < batch
            tl.store(LENS_OUT + ob, tl.load(LENS + ob, mask=okb, other=0).to(tl.int32),
                     mask=okb)
            okp = ob < batch + 1
            tl.store(PAGE_PTR_OUT + ob, tl.load(PAGE_PTR + ob, mask=okp, other=0).to(tl.int32),
                     mask=okp)
            tl.store(QO_OUT + ob, tl.load(QO + ob, mask=okp, other=0).to(tl.int32), mask=okp)
            b0 += BATCH_BLOCK


class ServingPlanLauncher:
    """The copy kernel compiled once per input dtypes and launched through its C launcher
    with integer pointers (Triton's Python launch path costs tens of microseconds of host
    time). Inputs must be contiguous and 16-byte aligned, as compiled (`aligned`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.interpret = device.type != "cuda"
        self._compiled: dict[tuple[torch.dtype, ...], tuple] = {}
        self._i32 = (torch.int32,) * 4

    @staticmethod
    def aligned(*ts: torch.Tensor) -> bool:
        return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in ts)

    def __call__(self, lens: torch.Tensor, page_idx: torch.Tensor, page_ptr: torch.Tensor,
                 qo: torch.Tensor, lens_out: torch.Tensor, idx_out: torch.Tensor,
                 page_ptr_out: torch.Tensor, qo_out: torch.Tensor) -> None:
        """Copy the call's metadata into the int32 buffers `lens_out`, `idx_out[:nnz]`,
        `page_ptr_out` and `qo_out`."""
        batch, nnz = page_ptr.numel() - 1, page_idx.numel()
        grid = triton.cdiv(max(nnz, 1), BLOCK)
        if self.interpret:
            serving_plan_kernel[(grid, 1, 1)](lens, page_idx, page_ptr, qo, lens_out, idx_out,
                                              page_ptr_out, qo_out, batch, nnz, BLOCK=BLOCK,
                                              BATCH_BLOCK=BATCH_BLOCK)
            return
        key = (lens.dtype, page_idx.dtype, page_ptr.dtype, qo.dtype)
        self._launch(self._kernel(key), lens.data_ptr(), page_idx.data_ptr(),
                     page_ptr.data_ptr(), qo.data_ptr(), lens_out.data_ptr(),
                     idx_out.data_ptr(), page_ptr_out.data_ptr(), qo_out.data_ptr(), batch, nnz)

    def launch_ptrs(self, lens: int, page_idx: int, page_ptr: int, qo: int, lens_out: int,
                    idx_out: int, page_ptr_out: int, qo_out: int, batch: int,
                    nnz: int) -> None:
        """`__call__` for int32 inputs given as (16-byte aligned) integer pointers."""
        self._launch(self._kernel(self._i32), lens, page_idx, page_ptr, qo, lens_out,
                     idx_out, page_ptr_out, qo_out, batch, nnz)

    def _kernel(self, dtypes: tuple[torch.dtype, ...]) -> tuple:
        """The compiled kernel for these input dtypes, its C launcher and fixed arguments."""
        k = self._compiled.get(dtypes)
        if k is None:
            from triton.runtime import driver

            from .mla_decode import _c_launch

            ins = [torch.empty(0, dtype=d, device=self.device) for d in dtypes]
            out = torch.empty(0, dtype=torch.int32, device=self.device)
            c = serving_plan_kernel.warmup(*ins, out, out, out, out, 2, 2, grid=(1, 1, 1),
                                           BLOCK=BLOCK, BATCH_BLOCK=BATCH_BLOCK, num_warps=4)
            c.run  # noqa: B018 - loads the module and creates the launcher
            md = c.metadata
            k = self._compiled[dtypes] = (
                _c_launch(c.run), (c.function, md.launch_cooperative_grid, md.launch_pdl,
                                   None, None, c.packed_metadata, None, None, None),
                driver.active.get_current_stream, driver.active.get_current_device())
        return k

    @staticmethod
    def _launch(k: tuple, *args: int) -> None:
        launch, fix, stream, dev = k
        nnz = args[-1]
        launch(triton.cdiv(max(nnz, 1), BLOCK), 1, 1, stream(dev), *fix, *args, BLOCK,
               BATCH_BLOCK)
