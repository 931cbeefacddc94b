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

Routing (mla_tune/runtime/buckets.py): a plan's bucket comes from host-visible metadata only: the
batch, the page size, and the mean length (from `kv_lens` when it is on the host, else
from the number of pages). Each bucket's runner is built once and reads the metadata as
given: its kernels compute their schedule from the lengths on the device (the Triton
family's balanced schedule, kernels/triton/mla_decode.py), so `plan` launches nothing and
allocates nothing; it checks and records the four tensors, and `run` is the decode
launch(es) only. Metadata the kernels cannot read as given (on the host, int64, not
contiguous or not 16-byte aligned) is copied into the wrapper's own buffers for the
bucket, one small launch where it is on the device (kernels/triton/serving_plan.py). A
plan whose mean length leaves the bucket picks another runner: `wrapper.bucket` says
which.

CUDA graphs. `run` captured in a graph reads the tensors of the plan before the capture
at every replay. Either write each later step's metadata into those same tensors (what
servers do with their graph-static buffers) and plan with them: a later plan of that
bucket with other tensors raises ValueError instead of replaying stale addresses; or
construct with `use_cuda_graph=True` (FlashInfer's flag): every plan then copies the
metadata into the wrapper's buffers (one small launch) and the graph reads only those,
whatever tensors later plans bring.

Launch graphs. On a GPU, most of a step's host time is the driver's launch of each kernel
(mla_tune/runtime/launch_graphs.py). With `graph_launches` (the default), a `run` whose
addresses (q, pool, metadata: a loop over graph-static or reused buffers) were those of
one of the bucket's last 128 eager runs captures its launches into a graph, and later
runs with them launch that graph: one driver call for the step's kernels. A run with new
addresses launches eagerly; a run inside the caller's own graph capture always does; a
capture that fails turns graphs off for the bucket. Up to 128 graphs per bucket: enough
for a model that plans once per step and runs each layer on its own pool.

Checks. `run` checks `q` and the pool (dtype, shape, device, layout, 16-byte alignment)
and raises ValueError before any launch (a pool checked once is not checked again while
its tensors live, up to 256 pools per bucket, nor a `q` whose storage has not moved: each
tensor query costs host time). `plan` checks the
page table in full (indptr monotone and ending at the number of indices, every length >=
q_len and within its pages, every used page index >= 0 and, at `run`, inside the pool):
on host tensors for free; device tensors are copied to the host for it, a
synchronization, unless `plan(..., check=False)` says they were checked already (serving
loops under `torch.cuda.set_sync_debug_mode("error")` or CUDA graphs). Such a plan with
the very tensor objects of the previous plan, at the same addresses (a server's persistent
buffers, rewritten each step), has nothing to do and returns after comparing them: the
kernels read the new contents on the device; with those very qo_indptr, kv_lens and
kv_indptr and a new kv_indices (a view of a page-index buffer as long as the step's pages),
only the new tensor is queried, and its page count only compared with the range of counts
that stay in the last plan's bucket (`pages_of_class`). It trusts that those tensors kept
their shape and dtype: after an in-place change of their metadata (`resize_`, `set_`),
plan with check=True or with new tensors.

Output. `run(q, kv_cache, out=o)` writes into `o`, a contiguous bf16 `(total_q, H, 512)`
tensor of the caller's (checked once while its storage stays put, as `q` is): a model's
layers each keep their own output, with no copy launch. Without `out`, the returned
tensor is the runner's own buffer, overwritten by the next `run` of its bucket: copy what
you keep.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from mla_tune.problem.shapes import MAX_Q_LEN, QK_HEAD_DIM, V_HEAD_DIM, KVFormat
from mla_tune.runtime.buckets import Bucket, BucketEdges, BucketRouter, BucketRunner, router_for
from mla_tune.runtime.launch_graphs import GraphedLaunch
from mla_tune.runtime.paged_inputs import check_page_table, check_pool, unpack_pool

_INTS = (torch.int32, torch.int64)
_I32 = torch.int32
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
"""Whether the current CUDA stream is capturing a graph (torch.cuda's own query, without
its Python frame)."""
_NAMES = ("qo_indptr", "kv_lens", "kv_indptr", "kv_indices")


def pages_of_class(kv_lo: int, kv_hi: int, batch: int, page_size: int, q_tokens: int
                   ) -> tuple[int, int]:
    """The page counts [first, last] that a fast-path plan of `batch` sequences puts in
    the kv class (kv_lo, kv_hi]. That plan takes pages x page_size tokens (at least the
    batch's q_tokens), averaged over the batch and rounded up, as the class's length: a
    count inside the range needs no class lookup. Serving steps change the count often
    (every step with pages of one token) without leaving the class."""
    last = kv_hi * batch // page_size
    first = 1 if q_tokens > kv_lo * batch else kv_lo * batch // page_size + 1
    return first, last


POOLS_PER_BUCKET = 256
"""Pools a bucket remembers as checked (a model runs each step once per layer, each layer
with its own pool: 61 in DeepSeek-V3); past that the record starts afresh."""


class _Route:
    """A bucket's runner and the state plans and runs of that bucket share: the wrapper's
    copy buffers (made on first need) with their addresses, the metadata addresses CUDA
    graphs captured, the last pool seen with its parts and addresses, and the pools
    checked before (by weak reference: that record keeps no pool alive)."""

    __slots__ = ("bucket", "runner", "paged", "launch", "graphed", "dummies", "q_shape",
                 "o_shape", "buffers", "captured", "pool", "pool_parts", "pool_ptrs", "pools")

    def __init__(self, bucket: Bucket, runner: BucketRunner, graphs: bool,
                 device: torch.device) -> None:
        self.bucket, self.runner, self.paged = bucket, runner, runner.paged
        launcher = getattr(runner, "launcher", None)
        # The Triton runner on a GPU launches from integer pointers (no tensor queries).
        self.launch = getattr(launcher, "launch_ptrs", None)
        self.graphed = GraphedLaunch(self.launch, device) \
            if graphs and self.launch is not None else None
        self.dummies = launcher.dummy_ptrs if self.launch is not None else (0, 0, 0)
        self.q_shape = torch.Size((bucket.batch * bucket.q_len, bucket.heads, QK_HEAD_DIM))
        self.o_shape = torch.Size((bucket.batch * bucket.q_len, bucket.heads, V_HEAD_DIM))
        self.buffers: dict[int, tuple[tuple[torch.Tensor, ...], tuple[int, ...]]] = {}
        self.captured: set[tuple[int, ...]] = set()
        self.pool: Any = None
        self.pool_parts: tuple = ()
        self.pool_ptrs: tuple[int, ...] = ()
        self.pools: dict[int, tuple[Any, Any, tuple[int, ...]]] = {}
        """id(the pool's values tensor) -> (weak references to it and to its scale(s),
        the pool's addresses and page count)."""


class MLADecodeWrapper:
    """Paged MLA decode through tuned bucket runners (module docstring: the contract)."""

    def __init__(self, kv_format: KVFormat | str = "bf16", num_heads: int = 16,
                 q_len: int = 1, page_size: int = 1,
                 device: str | torch.device | None = None, *, dispatcher: Any = None,
                 db: str | None = None, winners: str | None = None,
                 edges: BucketEdges | None = None, check_inputs: bool = True,
                 use_cuda_graph: bool = False, graph_launches: bool = True) -> None:
        """Winners come from `dispatcher`, else a winners JSON file `winners`, else the
        tuning DB `db` (a URL, a path, or 'shipped'; None: the Dispatcher's default).
        `graph_launches`: replay a run's launches from a graph once its addresses repeat
        (module docstring, "Launch graphs")."""
        from mla_tune.runtime.dispatcher import Dispatcher

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
        self._dev = self.device.index if self.device.type != "cpu" else -1
        if self._dev is None:
            self._dev = torch.cuda.current_device()
        self._cuda = self.device.type == "cuda"
        self.router: BucketRouter = router_for(dispatcher)
        if edges is not None:
            self.router = BucketRouter(dispatcher, edges)
        self.check_inputs = check_inputs
        self.use_cuda_graph = use_cuda_graph
        self.graph_launches = graph_launches and self._cuda
        self._direct = not use_cuda_graph
        self._runners: dict[tuple[Any, ...], BucketRunner] = {}
        self._routes: dict[tuple[int, int], _Route] = {}
        self._sized: dict[tuple[int, int], tuple[_Route, int, int]] = {}
        """Each (batch, pages) the fast plan path has seen: its route and the page counts
        of the route's class (pages_of_class): no class lookup."""
        self._aranges: dict[tuple[int, int, bool], torch.Tensor] = {}
        self._route: _Route | None = None
        self._bound: tuple[torch.Tensor, ...] = ()
        self._nnz = 0
        self._ptrs: tuple[int, ...] = ()
        self._key: tuple[int, ...] = ()
        self._max_len = 0
        self._max_page = -1
        self._q: Any = None
        self._q_ptr = 0
        self._o: Any = None
        self._o_ptr = 0
        self._plan_kernel: Any = False
        self._kv_class = self.router.edges.kv_class
        self._seen: tuple[torch.Tensor, ...] = ()
        """The metadata tensors of the last direct fast-path plan (the next one may skip)."""
        self._span: tuple[Any, int, int] = (None, 0, -1)
        """That plan's route and the page counts that stay in it (pages_of_class)."""

    @property
    def builds(self) -> int:
        """Runners built so far by this wrapper's router (flat inside a bucket)."""
        return self.router.builds

    @property
    def bucket(self) -> Bucket | None:
        """The bucket of the last plan."""
        return None if self._route is None else self._route.bucket

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
             kv_indices: torch.Tensor, kv_lens: torch.Tensor | Sequence[int], *,
             check: bool = True) -> None:
        """Take this step's page table (module docstring): choose the bucket's runner
        (built on the bucket's first plan) and record the metadata it reads."""
        if not check and self._plan_fast(qo_indptr, kv_indptr, kv_indices, kv_lens):
            return
        self._seen = ()
        if not isinstance(kv_lens, torch.Tensor):
            kv_lens = torch.tensor(list(kv_lens), dtype=torch.int32)
        meta = (qo_indptr, kv_lens, kv_indptr, kv_indices)
        dev = self._dev
        bind = not self.use_cuda_graph
        host = False
        for t in meta:
            if not isinstance(t, torch.Tensor) or t.dtype not in _INTS or t.dim() != 1:
                self._bad_meta(meta)
            if t.get_device() != dev:
                if t.is_cuda:
                    self._bad_meta(meta)
                bind, host = False, True
            elif bind and (t.dtype is not torch.int32 or t.data_ptr() & 15
                           or not t.is_contiguous()):
                bind = False
        batch = kv_indptr.shape[0] - 1
        nnz = kv_indices.shape[0]
        if batch < 1 or qo_indptr.shape[0] != batch + 1 or kv_lens.shape[0] != batch \
                or nnz < 1:
            self._bad_meta(meta)
        page = self.page_size
        host_lens = kv_lens.get_device() < 0
        if check:
            self._max_page, self._max_len = check_page_table(
                qo_indptr, kv_indptr, kv_indices, kv_lens, self.q_len, page)
        else:
            self._max_page = -1
            self._max_len = int(kv_lens.max()) if host_lens else nnz * page
        total = int(kv_lens.sum()) if host_lens else nnz * page  # pages: an upper bound
        hi = self.router.edges.kv_class(max(total, batch * self.q_len) / batch)[1]
        route = self._routes.get((batch, hi))
        if route is None:
            route = self._new_route(batch, hi)
        if bind:
            key = (qo_indptr.data_ptr(), kv_lens.data_ptr(), kv_indptr.data_ptr(),
                   kv_indices.data_ptr())
            if route.captured and key not in route.captured:
                raise ValueError(
                    f"bucket {route.bucket.label()}: a CUDA graph captured run with other "
                    "metadata tensors, and replays read those: write the new page table "
                    "into the captured tensors and plan with them, or construct the "
                    "wrapper with use_cuda_graph=True")
            self._bound, self._ptrs, self._key = meta, key, key
        else:
            bufs, self._ptrs = self._copy(route, meta, nnz, host)
            self._bound, self._key = bufs, ()
        self._nnz, self._route = nnz, route

    def _plan_fast(self, qo: Any, ptr: Any, idx: Any, lens: Any) -> bool:
        """`plan(check=False)` of int32, 1-D, contiguous, 16-byte aligned metadata on the
        GPU for a bucket seen before: the serving step, in as few tensor queries as it
        takes (each costs host time): direct reads, or with `use_cuda_graph` one copy
        launch. False: take the general path (which explains any refusal)."""
        seen = self._seen
        if seen and qo is seen[0] and lens is seen[1] and ptr is seen[2]:
            if idx is seen[3] and (qo.data_ptr(), lens.data_ptr(), ptr.data_ptr(),
                                   idx.data_ptr()) == self._key:
                return True  # the last plan's tensors, unmoved: its state stands
            if self._plan_new_indices(qo, lens, ptr, idx):
                return True
        dev = self._dev
        try:
            if not (lens.dtype is _I32 and idx.dtype is _I32 and ptr.dtype is _I32
                    and qo.dtype is _I32 and lens.get_device() == dev
                    and idx.get_device() == dev >= 0 and ptr.get_device() == dev
                    and qo.get_device() == dev):
                return False
            (n_ptr,), (nnz,), (n_lens,), (n_qo,) = ptr.shape, idx.shape, lens.shape, qo.shape
        except (AttributeError, ValueError):
            return False
        key = (qo.data_ptr(), lens.data_ptr(), ptr.data_ptr(), idx.data_ptr())
        batch = n_ptr - 1
        if (key[0] | key[1] | key[2] | key[3]) & 15 or batch < 1 or n_qo != n_ptr \
                or n_lens != batch or nnz < 1 or not (qo.is_contiguous()
                                                      and lens.is_contiguous()
                                                      and ptr.is_contiguous()
                                                      and idx.is_contiguous()):
            return False
        total = nnz * self.page_size  # pages: an upper bound on the tokens
        size = (batch, nnz)
        span = self._sized.get(size)
        if span is None:
            q_tokens = batch * self.q_len
            lo, hi = self._kv_class(-(-(total if total > q_tokens else q_tokens) // batch))
            route = self._routes.get((batch, hi))
            if route is None:
                return False
            if len(self._sized) >= 4096:
                self._sized.clear()
            span = self._sized[size] = (route, *pages_of_class(lo, hi, batch, self.page_size,
                                                                q_tokens))
        route = span[0]
        if self._direct:
            if route.captured and key not in route.captured:
                return False
            self._bound, self._ptrs, self._key = (qo, lens, ptr, idx), key, key
            self._seen, self._span = self._bound, span
        else:
            planner = self._planner()
            if planner is None:
                return False
            bufs, bptrs = self._buffers(route, nnz)
            planner.launch_ptrs(key[1], key[3], key[2], key[0], bptrs[1], bptrs[3],
                                bptrs[2], bptrs[0], batch, nnz)
            self._bound, self._ptrs, self._key = bufs, bptrs, ()
        self._max_page, self._max_len, self._nnz, self._route = -1, total, nnz, route
        return True

    def _plan_new_indices(self, qo: Any, lens: Any, ptr: Any, idx: Any) -> bool:
        """The fast path of a plan whose qo_indptr, kv_lens and kv_indptr are the last
        direct plan's tensor objects, unmoved, and whose kv_indices is new (a server's
        page-index buffer passed as a view as long as the step's pages: a new object every
        step): only the new tensor is queried, its page count compared with those of the
        last plan's class. False: take the whole fast path."""
        key = self._key
        if (qo.data_ptr(), lens.data_ptr(), ptr.data_ptr()) != key[:3]:
            return False
        try:
            if idx.dtype is not _I32 or idx.get_device() != self._dev:
                return False
            (nnz,) = idx.shape
        except (AttributeError, ValueError):
            return False
        idx_ptr = idx.data_ptr()
        route, first, last = self._span
        if not first <= nnz <= last or idx_ptr & 15 or not idx.is_contiguous():
            return False
        new_key = (key[0], key[1], key[2], idx_ptr)
        if route.captured and new_key not in route.captured:
            return False
        self._bound, self._ptrs, self._key = (qo, lens, ptr, idx), new_key, new_key
        self._seen = self._bound
        self._max_page, self._max_len, self._nnz, self._route = -1, nnz * self.page_size, \
            nnz, route
        return True

    def _bad_meta(self, meta: tuple) -> None:
        """Raise the ValueError that says what is wrong with a plan's metadata."""
        for t, n in zip(meta, _NAMES):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in _INTS or t.dim() != 1:
                raise ValueError(f"{n} must be a 1-D int32 tensor, got {t.dtype} of shape "
                                 f"{tuple(t.shape)}")
            if t.device.type != "cpu" and t.device != self.device:
                raise ValueError(f"{n} is on {t.device}; the wrapper runs on {self.device}")
        qo, lens, ptr, idx = meta
        batch = ptr.numel() - 1
        if batch < 1:
            raise ValueError("kv_indptr needs batch + 1 >= 2 entries")
        if idx.numel() < 1:
            raise ValueError("kv_indices is empty: every sequence needs at least one page")
        raise ValueError(f"kv_indptr gives batch {batch}; qo_indptr has {qo.numel()} entries "
                         f"(want {batch + 1}), kv_lens {lens.numel()} (want {batch})")

    def _new_route(self, batch: int, hi: int) -> _Route:
        """The runner of a bucket (built on first use) and its shared state."""
        lo = self.router.edges.kv_class(hi)[0]
        bucket = Bucket(batch, lo, hi, self.q_len, self.heads, self.kv_format, self.page_size)
        runner = self.router.runner(bucket, paged=True, cache=self._runners)
        route = self._routes[(batch, hi)] = _Route(bucket, runner, self.graph_launches,
                                                   self.device)
        return route

    def _buffers(self, route: _Route, nnz: int) -> tuple[tuple[torch.Tensor, ...],
                                                          tuple[int, ...]]:
        """The route's own int32 (qo_indptr, lens, kv_indptr, kv_indices) buffers and their
        addresses, sized once per page capacity: a batch of the bucket's pages, or the
        next power of two for a wider block table."""
        b = route.bucket
        cap = b.batch * -(-b.kv_hi // self.page_size) + b.batch
        if nnz > cap:
            cap = 1 << (nnz - 1).bit_length()
        got = route.buffers.get(cap)
        if got is None:
            z = lambda n: torch.zeros(n, dtype=torch.int32, device=self.device)  # noqa: E731
            bufs = (z(b.batch + 1), z(b.batch), z(b.batch + 1), z(cap))
            got = route.buffers[cap] = (bufs, tuple(t.data_ptr() for t in bufs))
        return got

    def _copy(self, route: _Route, meta: tuple, nnz: int, host: bool
              ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        """The metadata copied into the route's own buffers: (buffers, their addresses)."""
        bufs, ptrs = self._buffers(route, nnz)
        qo, lens, ptr, idx = meta
        planner = None if host else self._planner()
        if planner is not None and planner.aligned(*meta):
            planner(lens, idx, ptr, qo, bufs[1], bufs[3], bufs[2], bufs[0])
        else:
            nb = self._cuda
            for src, dst in zip(meta, bufs):
                dst[:src.shape[0]].copy_(src.to(torch.int32) if src.get_device() < 0 else src,
                                         non_blocking=nb)
        return bufs, ptrs

    def _planner(self) -> Any:
        """The copy kernel's launcher where Triton runs (a CUDA device, or the
        interpreter on CPU), else None (torch copies instead)."""
        if self._plan_kernel is False:
            self._plan_kernel = None
            interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            if self._cuda or interp:
                try:
                    from mla_tune.kernels.triton.serving_plan import ServingPlanLauncher

                    self._plan_kernel = ServingPlanLauncher(self.device)
                except Exception:  # noqa: BLE001 - no Triton: the torch copies do the same
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
        on_host = block_table.get_device() < 0
        indptr = self._arange(batch, width, on_host)
        if qo_indptr is None:
            qo_indptr = self._arange(batch, self.q_len, on_host)
        self.plan(qo_indptr, indptr, block_table.reshape(-1), seq_lens, check=check)

    def _arange(self, batch: int, step: int, on_host: bool) -> torch.Tensor:
        """`arange(batch + 1) * step` int32 on the host or the device, made once."""
        key = (batch, step, on_host)
        t = self._aranges.get(key)
        if t is None:
            t = torch.arange(batch + 1, dtype=torch.int32) * step
            t = self._aranges[key] = t if on_host else t.to(self.device)
        return t

    def run(self, q: torch.Tensor, kv_cache: Any, *, out: torch.Tensor | None = None
            ) -> torch.Tensor:
        """Decode attention of the planned batch: `(total_q, H, 512)` bf16. Written into
        `out` where given (a contiguous bf16 tensor of that shape: a layer's own output,
        FlashInfer's `out=`), else into the runner's buffer (module docstring)."""
        route = self._route
        if route is None:
            raise ValueError("run before plan: call plan(qo_indptr, kv_indptr, kv_indices, "
                             "kv_lens) first")
        if kv_cache is not route.pool:
            self._new_pool(route, kv_cache)
        if self.check_inputs:
            if self._max_page >= route.pool_ptrs[4]:
                raise ValueError(f"the page table uses page {self._max_page}; the pool has "
                                 f"{route.pool_ptrs[4]} pages")
            # A tensor checked before is checked again only if its storage moved.
            if q is not self._q or q.data_ptr() != self._q_ptr or q.shape != route.q_shape:
                if type(q) is not torch.Tensor or q.dtype is not torch.bfloat16 \
                        or q.shape != route.q_shape or q.get_device() != self._dev \
                        or not q.is_contiguous() or q.data_ptr() & 15:
                    self._bad_q(q, route)
                self._q, self._q_ptr = q, q.data_ptr()
            q_ptr = self._q_ptr
            o_ptr = 0
            if out is not None:
                if out is not self._o or out.data_ptr() != self._o_ptr \
                        or out.shape != route.o_shape:
                    if type(out) is not torch.Tensor or out.dtype is not torch.bfloat16 \
                            or out.shape != route.o_shape or out.get_device() != self._dev \
                            or not out.is_contiguous() or out.data_ptr() & 15:
                        self._bad_out(out, route)
                    self._o, self._o_ptr = out, out.data_ptr()
                o_ptr = self._o_ptr
        else:
            q_ptr = q.data_ptr() if route.launch is not None else 0
            o_ptr = out.data_ptr() if out is not None and route.launch is not None else 0
        if route.launch is not None:
            launch = route.graphed or route.launch
            if self._cuda and _capturing():  # the caller's graph records eager launches
                launch = route.launch
                if self._key:
                    route.captured.add(self._key)
            kv_p, scale_p, sc_p, sc_stride = route.pool_ptrs[:4]
            qo_p, lens_p, ptr_p, idx_p = self._ptrs
            result = launch(q_ptr, kv_p, scale_p, sc_p, sc_stride, qo_p, lens_p, idx_p, ptr_p,
                            o_ptr)
            return result if out is None else out
        if self._key and self._cuda and _capturing():
            route.captured.add(self._key)
        kv, scale, sc = route.pool_parts
        qo, lens, ptr, idx = self._bound
        return route.paged(q, kv, scale, sc, qo, lens, ptr, idx[:self._nnz], self._max_len,
                           out)

    def _new_pool(self, route: _Route, kv_cache: Any) -> None:
        """Record the pool of a run whose pool is not the last run's: a pool checked before
        (the same tensors, alive) is taken as it was; another is checked (with
        check_inputs) and its parts and addresses (the dummies' where it has no scale or
        scales) and page count recorded."""
        bf16 = self.kv_format is KVFormat.BF16
        if bf16:
            values, other = kv_cache, None
        elif isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
            values, other = kv_cache
        else:
            values = other = None
        known = route.pools.get(id(values))
        if known is not None and known[0]() is values and (bf16 or known[1]() is other):
            route.pool_parts = unpack_pool(self.kv_format, kv_cache)
            route.pool_ptrs, route.pool = known[2], kv_cache
            return
        parts = self._pool(kv_cache) if self.check_inputs else unpack_pool(self.kv_format,
                                                                       kv_cache)
        kv, scale, sc = parts
        if route.launch is not None and (kv.data_ptr() | (0 if scale is None else
                                                          scale.data_ptr())
                                         | (0 if sc is None else sc.data_ptr())) & 15:
            raise ValueError("the pool's tensors must be 16-byte aligned (the kernels are "
                             "compiled for it)")
        d_scale, d_sc, _ = route.dummies
        route.pool_ptrs = (kv.data_ptr(), d_scale if scale is None else scale.data_ptr(),
                           d_sc if sc is None else sc.data_ptr(),
                           0 if sc is None else sc.stride(0), kv.shape[0])
        route.pool_parts, route.pool = parts, kv_cache
        if isinstance(values, torch.Tensor) and (bf16 or isinstance(other, torch.Tensor)):
            if len(route.pools) >= POOLS_PER_BUCKET:
                route.pools.clear()
            route.pools[id(values)] = (weakref.ref(values),
                                       None if bf16 else weakref.ref(other), route.pool_ptrs)

    def _bad_q(self, q: Any, route: _Route) -> None:
        want = (route.bucket.batch * self.q_len, self.heads, QK_HEAD_DIM)
        got = (f"{q.dtype} {tuple(q.shape)} on {q.device}" if isinstance(q, torch.Tensor)
               else type(q).__name__)
        raise ValueError(f"q must be a contiguous bfloat16 tensor of shape {want} on "
                         f"{self.device}; got {got}")

    def _bad_out(self, out: Any, route: _Route) -> None:
        got = (f"{out.dtype} {tuple(out.shape)} on {out.device}"
               + ("" if out.is_contiguous() else ", not contiguous")
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"out must be a contiguous, 16-byte aligned bfloat16 tensor of shape "
                         f"{tuple(route.o_shape)} on {self.device}; got {got}")

    def _pool(self, kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor | None,
                                            torch.Tensor | None]:
        """Check a pool of this wrapper's format, page size and device (check_pool)."""
        return check_pool(kv_cache, self.kv_format, self.page_size, self.device)


__all__ = ["MLADecodeWrapper"]
