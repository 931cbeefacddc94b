"""`MLADecodeWrapper`: tuned MLA decode over a paged KV pool, with FlashInfer's plan/run shape.

A server that uses `flashinfer.mla.BatchMLAPagedAttentionWrapper` switches with a few lines:

    from mla_tune import MLADecodeWrapper
    w = MLADecodeWrapper(kv_format="bf16", num_heads=16, q_len=1, page_size=64, device="cuda")
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens)   # page table as FlashInfer takes it
    out = w.run(q, kv_cache)                             # (total_q, H, 512) bf16

Page table: sequence b owns pages `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` of the pool, in
order, anywhere in it; `kv_lens[b]` is its length in tokens (at most its pages' capacity).
`qo_indptr` is `arange(batch + 1) * q_len`. Each may be a CPU or a device tensor.
The block-table form of vLLM and FlashMLA (`block_table (batch, max_blocks)`, `seq_lens`)
goes through `plan_block_table`, which is the same call with `kv_indices =
block_table.flatten()` and `kv_indptr = arange(batch + 1) * max_blocks` (entries past a
sequence's last page are never read and may hold anything, -1 included).

Pools (`run`'s `kv_cache`): bf16 `(num_pages, page_size, 576)`; fp8 `(pool, scale)` with
`scale` a `(1,)` float32; MXFP4 `(packed, scales)` with packed `(num_pages, page_size, 288)`
uint8 and one row of E8M0 bytes per token slot, `(num_pages * page_size, >= 18)`.

Routing (mla_tune/buckets.py): a plan's bucket comes from host-visible metadata only: the
batch, the page size, and the mean length (from `kv_lens` when it is on the host, else
from the number of pages). Each bucket's runner is built once; later plans of the bucket
write the new page table, lengths and query indptr into fixed buffers (the cumulative
tokens, each page's first cache row, copies of the indptrs: one small Triton launch,
kernels/triton/serving_plan.py, where the metadata is on the device; torch ops otherwise),
so `plan` allocates no device memory, `run` is only the decode kernel launch(es) and reads
only those buffers, neither synchronizes, and `run` can be captured in a CUDA graph once
per bucket and replayed after every later plan of the bucket: per step, `plan` (outside
the graph), then replay. A plan whose mean length leaves the bucket picks another runner:
check `wrapper.bucket` to know which graph to replay.

Checks. `run` checks `q` and the pool (dtype, shape, device, layout) and raises ValueError
before any launch. `plan` checks the page table in full (indptr monotone and ending at the
number of indices, every length >= q_len and within its pages, every used page index >= 0
and, at `run`, inside the pool): on host tensors for free; device tensors are copied to
the host for it, a synchronization, unless `plan(..., check=False)` says they were checked
already (serving loops under `torch.cuda.set_sync_debug_mode("error")` or CUDA graphs).
The returned output is the runner's own buffer, overwritten by the next `run` of its
bucket: copy what you keep.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from mla_tune.buckets import Bucket, BucketEdges, BucketRouter, BucketRunner, router_for
from mla_tune.problem import MAX_Q_LEN, QK_HEAD_DIM, KVFormat

_FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz})
_U8 = frozenset({torch.uint8} | ({torch.float4_e2m1fn_x2}
                                 if hasattr(torch, "float4_e2m1fn_x2") else set()))
_E8M0 = frozenset({torch.uint8} | ({torch.float8_e8m0fnu}
                                   if hasattr(torch, "float8_e8m0fnu") else set()))
_INTS = (torch.int32, torch.int64)


class MLADecodeWrapper:
    """Paged MLA decode through tuned bucket runners (module docstring: the contract)."""

    def __init__(self, kv_format: KVFormat | str = "bf16", num_heads: int = 16,
                 q_len: int = 1, page_size: int = 1,
                 device: str | torch.device | None = None, *, dispatcher: Any = None,
                 db: str | None = None, winners: str | None = None,
                 edges: BucketEdges | None = None, check_inputs: bool = True) -> None:
        """Winners come from `dispatcher`, else a winners JSON file `winners`, else the
        tuning DB `db` (a URL, a path, or 'shipped'; None: the Dispatcher's default)."""
        from mla_tune.dispatch import Dispatcher

        self.kv_format = KVFormat.parse(kv_format) if isinstance(kv_format, str) \
            else KVFormat(kv_format)
        if type(num_heads) is not int or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if type(q_len) is not int or not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(f"q_len must be an int in 1..{MAX_Q_LEN}, got {q_len!r}")
        if type(page_size) is not int or page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {page_size!r}")
        self.heads, self.q_len, self.page_size = num_heads, q_len, page_size
        if dispatcher is None:
            if winners is not None:
                dispatcher = Dispatcher.from_json(winners, device)
            else:
                dispatcher = Dispatcher.from_db(db, device)
        self.dispatcher = dispatcher
        self.device: torch.device = dispatcher.device
        self.router: BucketRouter = router_for(dispatcher)
        if edges is not None:
            self.router = BucketRouter(dispatcher, edges)
        self.check_inputs = check_inputs
        self._bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._runners: dict[tuple[Any, ...], BucketRunner] = {}
        self._routes: dict[tuple[int, int, int], tuple[Any, ...]] = {}
        self._runner: BucketRunner | None = None
        self._bucket: Bucket | None = None
        self._qo: torch.Tensor | None = None
        self._tok: torch.Tensor | None = None
        self._max_len = 0
        self._max_page = -1
        self._plan_kernel: Any = False

    @property
    def builds(self) -> int:
        """Runners built so far by this wrapper's router (flat inside a bucket)."""
        return self.router.builds

    @property
    def bucket(self) -> Bucket | None:
        """The bucket of the last plan."""
        return self._bucket

    def _buffers(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(qo_indptr, cumulative kv tokens) buffers of a batch size, made once."""
        b = self._bufs.get(batch)
        if b is None:
            qo = torch.arange(batch + 1, dtype=torch.int32, device=self.device) * self.q_len
            tok = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)
            b = self._bufs[batch] = (qo, tok)
        return b

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
             kv_indices: torch.Tensor, kv_lens: torch.Tensor | Sequence[int], *,
             check: bool = True) -> None:
        """Take this step's page table (module docstring); chooses the bucket's runner
        (built on the bucket's first plan) and writes its index buffers."""
        if not isinstance(kv_lens, torch.Tensor):
            kv_lens = torch.tensor(list(kv_lens), dtype=torch.int32)
        meta = (kv_lens, kv_indices, kv_indptr, qo_indptr)
        on_device = True
        for t, n in zip(meta, ("kv_lens", "kv_indices", "kv_indptr", "qo_indptr")):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _INTS or t.dim() != 1:
                raise ValueError(f"{n} must be a 1-D int32 tensor, got {t.dtype} of shape "
                                 f"{tuple(t.shape)}")
            if t.device != self.device:
                if t.device.type != "cpu":
                    raise ValueError(f"{n} is on {t.device}; the wrapper runs on "
                                     f"{self.device}")
                on_device = False
        batch = kv_indptr.numel() - 1
        if batch < 1:
            raise ValueError("kv_indptr needs batch + 1 >= 2 entries")
        if qo_indptr.numel() != batch + 1 or kv_lens.numel() != batch:
            raise ValueError(f"kv_indptr gives batch {batch}; qo_indptr has "
                             f"{qo_indptr.numel()} entries (want {batch + 1}), kv_lens "
                             f"{kv_lens.numel()} (want {batch})")
        nnz = kv_indices.numel()
        if nnz < 1:
            raise ValueError("kv_indices is empty: every sequence needs at least one page")
        page = self.page_size
        host_lens = kv_lens.device.type == "cpu"
        if check:
            self._max_page, self._max_len = _check_table(
                qo_indptr, kv_indptr, kv_indices, kv_lens, self.q_len, page)
        else:
            self._max_page = -1
            self._max_len = int(kv_lens.max()) if host_lens else nnz * page
        total = int(kv_lens.sum()) if host_lens else nnz * page  # pages: an upper bound
        lo, hi = self.router.edges.kv_class(max(total, batch * self.q_len) / batch)
        # Pages a batch of this bucket can use; a block table (whose unused entries count
        # too) may hold more: then the next power of two, constant for a table width.
        cap = batch * -(-hi // page) + batch
        if nnz > cap:
            cap = 1 << (nnz - 1).bit_length()
        route = self._routes.get((batch, hi, cap))
        if route is None:
            bucket = Bucket(batch, lo, hi, self.q_len, self.heads, self.kv_format, page)
            runner = self.router.runner(bucket, paged=True, page_capacity=cap,
                                        cache=self._runners)
            assert runner.page_rows is not None and runner.page_indptr is not None
            route = self._routes[(batch, hi, cap)] = (bucket, runner) + self._buffers(batch)
        bucket, runner, qo_buf, tok = route
        planner = self._planner()
        if planner is not None and on_device and planner.aligned(*meta):
            # One launch writes every buffer (no allocation, no scan scratch).
            planner(kv_lens, kv_indices, kv_indptr, qo_indptr, tok, runner.page_rows,
                    runner.page_indptr, qo_buf, page)
        else:
            nb = self.device.type != "cpu"
            # Lengths -> cumulative tokens (what the kernels read); pages -> first row.
            if host_lens:
                tok[1:].copy_(torch.cumsum(kv_lens, 0, dtype=torch.int32), non_blocking=nb)
            else:
                torch.cumsum(kv_lens, 0, dtype=torch.int32, out=tok[1:])
            rows = runner.page_rows[:nnz]
            if kv_indices.device.type == "cpu":
                rows.copy_(kv_indices.to(torch.int32) * page, non_blocking=nb)
            else:
                torch.mul(kv_indices, page, out=rows)
            runner.page_indptr.copy_(kv_indptr, non_blocking=nb)
            qo_buf.copy_(qo_indptr, non_blocking=nb)
        # `run` reads only these buffers, so a graph captured after one plan replays any
        # later plan of the bucket, whatever tensors the caller passes.
        self._qo, self._tok, self._runner, self._bucket = qo_buf, tok, runner, bucket

    def _planner(self) -> Any:
        """The planning kernel's launcher where Triton runs (a CUDA device, or the
        interpreter on CPU), else None (torch ops instead)."""
        if self._plan_kernel is False:
            self._plan_kernel = None
            interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            if self.device.type == "cuda" or interp:
                try:
                    from kernels.triton.serving_plan import ServingPlanLauncher

                    self._plan_kernel = ServingPlanLauncher(self.device)
                except Exception:  # noqa: BLE001 - no Triton: the torch ops do the same
                    self._plan_kernel = None
        return self._plan_kernel

    def plan_block_table(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         qo_indptr: torch.Tensor | None = None, *, check: bool = True) -> None:
        """The block-table form (vLLM, FlashMLA): `block_table[b, k]` is the k-th page of
        sequence b. Same as `plan` with `kv_indices = block_table.flatten()` and
        `kv_indptr = arange(batch + 1) * max_blocks` (module docstring)."""
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError("block_table must be a 2-D (batch, max_blocks) int tensor")
        batch, width = block_table.shape
        indptr = torch.arange(batch + 1, dtype=torch.int32) * width
        if block_table.device.type != "cpu":
            indptr = self._block_indptr(batch, width)
        if qo_indptr is None:
            qo_indptr = self._buffers(batch)[0]
        self.plan(qo_indptr, indptr, block_table.reshape(-1), seq_lens, check=check)

    def _block_indptr(self, batch: int, width: int) -> torch.Tensor:
        """`arange(batch + 1) * width` on the device, made once per (batch, width)."""
        cache = self.__dict__.setdefault("_block_ptrs", {})
        t = cache.get((batch, width))
        if t is None:
            t = cache[(batch, width)] = torch.arange(
                batch + 1, dtype=torch.int32, device=self.device) * width
        return t

    def run(self, q: torch.Tensor, kv_cache: Any) -> torch.Tensor:
        """Decode attention of the planned batch: `(total_q, H, 512)` bf16 (the runner's
        buffer; module docstring)."""
        runner = self._runner
        if runner is None:
            raise ValueError("run before plan: call plan(qo_indptr, kv_indptr, kv_indices, "
                             "kv_lens) first")
        kv, scale, sc = self._pool(kv_cache) if self.check_inputs else _unpack(
            self.kv_format, kv_cache)
        if self.check_inputs:
            want = (runner.batch * self.q_len, self.heads, QK_HEAD_DIM)
            if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 \
                    or tuple(q.shape) != want or q.device != self.device \
                    or not q.is_contiguous():
                raise ValueError(f"q must be a contiguous bfloat16 tensor of shape {want} on "
                                 f"{self.device}; got "
                                 + (f"{q.dtype} {tuple(q.shape)} on {q.device}"
                                    if isinstance(q, torch.Tensor) else type(q).__name__))
        return runner(q, kv, scale, sc, self._qo, self._tok, self._max_len)

    def _pool(self, kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor | None,
                                            torch.Tensor | None]:
        """Check the pool of this format and page size; (values, fp8 scale, MXFP4 scales)."""
        fmt, page = self.kv_format, self.page_size
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
                or kv.device != self.device:
            got = (f"{kv.dtype} {tuple(kv.shape)} on {kv.device}"
                   if isinstance(kv, torch.Tensor) else type(kv).__name__)
            raise ValueError(f"the {fmt.value} pool must be a contiguous "
                             f"(num_pages, {page}, {width}) tensor of "
                             f"{'/'.join(sorted(map(str, dtypes)))} on {self.device}; got {got}")
        pages = kv.shape[0]
        if self._max_page >= pages:
            raise ValueError(f"the page table uses page {self._max_page}; the pool has "
                             f"{pages} pages")
        if fmt is KVFormat.FP8:
            if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 \
                    or scale.numel() != 1 or scale.device != self.device:
                raise ValueError("the fp8 scale must be a (1,) float32 tensor on "
                                 f"{self.device}")
        elif fmt is KVFormat.MXFP4:
            if not isinstance(sc, torch.Tensor) or sc.dtype not in _E8M0 or sc.dim() != 2 \
                    or sc.shape[0] < pages * page or sc.shape[1] < QK_HEAD_DIM // 32 \
                    or sc.stride(1) != 1 or sc.device != self.device:
                raise ValueError(f"the MXFP4 scales must be a ({pages * page}, >= 18) uint8 "
                                 f"tensor (one row per token slot, rows contiguous) on "
                                 f"{self.device}")
            if kv.dtype != torch.uint8:
                kv = kv.view(torch.uint8)
            if sc.dtype != torch.uint8:
                sc = sc.view(torch.uint8)
        return kv, scale, sc


def _unpack(fmt: KVFormat, kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor | None,
                                                   torch.Tensor | None]:
    """The pool's parts unchecked (`check_inputs=False`)."""
    if fmt is KVFormat.BF16:
        return kv_cache, None, None
    if fmt is KVFormat.FP8:
        return kv_cache[0], kv_cache[1], None
    kv, sc = kv_cache
    return (kv if kv.dtype == torch.uint8 else kv.view(torch.uint8)), None, \
        (sc if sc.dtype == torch.uint8 else sc.view(torch.uint8))


def _check_table(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 kv_lens: torch.Tensor, q_len: int, page: int) -> tuple[int, int]:
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


__all__ = ["MLADecodeWrapper"]
