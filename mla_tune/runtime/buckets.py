"""Length buckets: one built runner per bucket of ragged, growing decode batches.

A serving loop calls decode attention every step with new lengths. Building a variant per
tuple of lengths (what an exact-shape cache does) costs a build per step, so calls whose
lengths the host does not hold exactly are routed by a bucket instead:

    bucket = (batch, kv class of the mean length, q_len, heads, KV format, page size)

- batch is exact: the output and partial buffers are sized by it (servers pad their
  batch to a few sizes already, as they do for CUDA graphs);
- the kv class is the smallest edge >= the mean kv length, on a log scale: by default the
  powers of two 64 .. 1048576 (`DEFAULT_KV_EDGES`). Edges are configurable with
  `MLA_TUNE_KV_BUCKETS="256,1024,4096,..."` or `BucketEdges(...)`. A class is routed as
  the uniform batch at the geometric middle of its range (`Bucket.representative`).

Everything that defines a bucket is host-visible without reading device memory: batch from
the config (or `qo_indptr`'s length), the mean from the number of KV tokens (the KV
tensor's first dimension, or the host-side lengths or page count of a paged call). Routing
therefore never synchronizes and is the same on every rank.

A bucket runner reads each sequence's length on the device (from `kv_indptr`, or a paged
call's lengths), and the schedule (which program reads which KV range, how many partials
each sequence merges) is computed there from them: the Triton build runs the token-balanced
schedule ("Balanced schedule" in kernels/triton/mla_decode.py: the keys of the whole batch
cut evenly between a fixed number of programs, so long sequences make no tail), so one
runner serves every length of its bucket with no rebuild, recompile or allocation, and a
call is capturable in a CUDA graph. A tuned split count sets how many waves of programs
run, a tuned `seg_cost` the setup charged per sequence. The runner is the one a ragged
sweep of the bucket builds and times (`balanced_launcher` in kernels/triton/launch.py).
Variant choice per bucket, first that builds:
0. `MLA_TUNE_FORCE`, where feasible;
1. a winner tuned on a ragged batch of this bucket ("exact"); for a paged bucket without
   one, the contiguous (page 1) bucket's (`winner_pages`);
2. the nearest tuned uniform shape of the same format/heads/q_len (its own page size
   first, then contiguous winners), by log distance over (batch, kv length);
3. the dispatcher's occupancy heuristic; 4. the torch family.
A tuned config is made length-independent first (`bucket_config`): `kv_load='tma_host'`
needs every length a multiple of the tile and runs as `'tma'` (per-program descriptors,
the same tiles) on a contiguous cache; paged reads use pointer loads; the page-size knob
is the call's own page size. Families without a bucket build (FlashInfer, aiter) are
routed around.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from mla_tune.problem.shapes import (
    QK_HEAD_DIM,
    SM_SCALE,
    V_HEAD_DIM,
    KVFormat,
    Shape,
    ShapeError,
    TaskInput,
)
from mla_tune.runtime.bucket_rules import (
    BUCKET_BACKENDS,
    DEFAULT_KV_EDGES,
    KV_BUCKETS_ENV,
    bucket_config,
    check_kv_edges,
    is_ragged_rows,
    kv_class,
    kv_edges_from_env,
    parse_kv_edges,
    rep_len,
    winner_pages,
)
from mla_tune.runtime.input_checks import (
    E8M0_DTYPES,
    FP4_DTYPES,
    FP4_PACKED_DIM,
    FP8_DTYPES,
    MXFP4_BLOCKS,
    check_tensor,
    kv_rows,
)
from mla_tune.tuning.space import config_key

if TYPE_CHECKING:
    from mla_tune.runtime.routing import Decision, RoutingTable

log = logging.getLogger(__name__)

_FORMAT_ORDER = (KVFormat.BF16, KVFormat.FP8, KVFormat.MXFP4)


@dataclass(frozen=True)
class BucketEdges:
    """Upper edges of the kv classes (of the mean kv length), ascending."""

    kv: tuple[int, ...] = DEFAULT_KV_EDGES

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv", check_kv_edges(self.kv))

    @classmethod
    def parse(cls, text: str) -> "BucketEdges":
        """`"256,1024,4096"` -> edges; what `MLA_TUNE_KV_BUCKETS` holds."""
        return cls(parse_kv_edges(text))

    @classmethod
    def from_env(cls) -> "BucketEdges":
        return cls(kv_edges_from_env(os.environ))

    def kv_class(self, mean_kv: float) -> tuple[int, int]:
        """(lower edge exclusive, upper edge inclusive) of the class holding `mean_kv`;
        past the last edge, classes keep doubling."""
        return kv_class(self.kv, mean_kv)


@dataclass(frozen=True)
class Bucket:
    """A class of decode calls that one built runner serves (module docstring)."""

    batch: int
    kv_lo: int
    kv_hi: int
    q_len: int
    heads: int
    kv_format: KVFormat
    page_size: int = 1

    @property
    def rep_len(self) -> int:
        """The class's representative length: the geometric middle of (kv_lo, kv_hi]
        (of (kv_hi / 2, kv_hi] for the first class)."""
        return rep_len(self.kv_lo, self.kv_hi, self.q_len)

    def representative(self) -> Shape:
        """The uniform shape this bucket is routed and built as."""
        return Shape.uniform(self.batch, self.rep_len, q_len=self.q_len, heads=self.heads,
                             kv_format=self.kv_format, page_size=self.page_size)

    def label(self) -> str:
        return (f"{self.batch}x({self.kv_lo},{self.kv_hi}] {self.kv_format.value} "
                f"h{self.heads} q{self.q_len} p{self.page_size}")


def bucket_of(shape: Shape, edges: BucketEdges | None = None) -> Bucket:
    """The bucket of a (ragged or uniform) shape, by its mean kv length."""
    lo, hi = (edges or BucketEdges()).kv_class(shape.total_kv / shape.batch)
    return Bucket(shape.batch, lo, hi, shape.q_len, shape.heads, shape.kv_format,
                  shape.page_size)


# -- runners ---------------------------------------------------------------------------


class BucketRunner(ABC):
    """A built variant serving any lengths of its bucket. Contiguous: `(q, kv, kv_scale,
    kv_sc, qo_indptr, kv_indptr, max_len) -> out`, `kv_indptr` cumulative tokens. Paged
    (built with `paged=True`): `paged(q, pool, kv_scale, kv_sc, qo_indptr, kv_lens,
    page_indptr, page_idx, max_len, out=None) -> out`, FlashInfer's metadata as a server
    holds it: int32 tensors on the device, sequence b's pages `page_idx[page_indptr[b]:
    page_indptr[b + 1]]`, its length `kv_lens[b]`. `max_len` is a host bound on the
    longest sequence (the torch build pads to it; the Triton build ignores it). Returns the
    runner's own output buffer, or the paged call's `out` (a contiguous bf16 (batch x q_len,
    heads, 512) tensor of the caller's) written in place."""

    def __init__(self, decision: "Decision", batch: int, q_len: int, heads: int,
                 paged: bool) -> None:
        self.decision = decision
        self.batch, self.q_len, self.heads = batch, q_len, heads
        self.is_paged = paged

    @abstractmethod
    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, max_len: int) -> torch.Tensor:
        """Decode attention of one contiguous call (class docstring)."""

    @abstractmethod
    def paged(self, q: torch.Tensor, pool: torch.Tensor, kv_scale: torch.Tensor | None,
              kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor, kv_lens: torch.Tensor,
              page_indptr: torch.Tensor, page_idx: torch.Tensor, max_len: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of one paged call (class docstring)."""


class _TritonBucket(BucketRunner):
    """The Triton family's balanced-schedule launcher (kernels/triton/mla_decode.py,
    `BalancedLauncher`) built once for the bucket's batch: its kernels split the keys of
    the whole batch evenly between programs from the lengths on the device, so one build
    serves every length. Built by `balanced_launcher` (kernels/triton/launch.py), as a
    ragged sweep builds the variants it times."""

    def __init__(self, decision: "Decision", shape: Shape, paged: bool,
                 device: torch.device) -> None:
        super().__init__(decision, shape.batch, shape.q_len, shape.heads, paged)
        from mla_tune.kernels.triton.launch import balanced_launcher

        self.launcher = balanced_launcher(
            shape.kv_format.value, shape.batch, shape.q_len, shape.heads, decision.config,
            device, paged=paged, page_size=shape.page_size, sm_scale=SM_SCALE)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, max_len: int) -> torch.Tensor:
        return self.launcher(q, kv, kv_scale, kv_sc, qo_indptr, kv_indptr)

    def paged(self, q: torch.Tensor, pool: torch.Tensor, kv_scale: torch.Tensor | None,
              kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor, kv_lens: torch.Tensor,
              page_indptr: torch.Tensor, page_idx: torch.Tensor, max_len: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        return self.launcher(q, pool, kv_scale, kv_sc, qo_indptr, kv_lens, page_indptr,
                             page_idx, out)


class _TorchBucket(BucketRunner):
    """The torch family's bucket build: one gather of every sequence's keys padded to
    `max_len` (through the page table when paged), a causal/length mask built from the
    lengths on the device, one softmax. Slow but exact and everywhere; the CPU path."""

    def __init__(self, decision: "Decision", shape: Shape, paged: bool,
                 device: torch.device) -> None:
        super().__init__(decision, shape.batch, shape.q_len, shape.heads, paged)
        self.fmt = shape.kv_format
        self.page_shift = shape.page_size.bit_length() - 1
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}
        self.dtype = names.get(str(decision.config.get("compute_dtype", "float32")),
                               torch.float32)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, max_len: int) -> torch.Tensor:
        kvp = kv_indptr.to(torch.long)
        t = torch.arange(max(int(max_len), 1), device=q.device)
        return self._attend(q, kv, kv_scale, kv_sc, kvp[1:] - kvp[:-1],
                            kvp[:-1, None] + t[None, :], t)

    def paged(self, q: torch.Tensor, pool: torch.Tensor, kv_scale: torch.Tensor | None,
              kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor, kv_lens: torch.Tensor,
              page_indptr: torch.Tensor, page_idx: torch.Tensor, max_len: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        t = torch.arange(max(int(max_len), 1), device=q.device)
        idx = page_idx.to(torch.long)
        slot = page_indptr[:-1].to(torch.long)[:, None] + (t >> self.page_shift)
        slot = slot.clamp(0, idx.numel() - 1)
        phys = (idx[slot] << self.page_shift) + (t & ((1 << self.page_shift) - 1))
        o = self._attend(q, pool, kv_scale, kv_sc, kv_lens.to(torch.long), phys, t)
        return o if out is None else out.copy_(o)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                kv_sc: torch.Tensor | None, lens: torch.Tensor, phys: torch.Tensor,
                t: torch.Tensor) -> torch.Tensor:
        """Attention over the cache rows `phys` (B, T) of each sequence, `lens` long."""
        from mla_tune.problem import quant

        dev = q.device
        b, ql, h = self.batch, self.q_len, self.heads
        width = kv.shape[-1]
        flat = kv.reshape(-1, width)
        valid = t[None, :] < lens[:, None]
        phys = torch.where(valid, phys, torch.zeros_like(phys)).clamp(0, flat.shape[0] - 1)
        rows = flat[phys]  # (B, T, width) as stored
        if self.fmt is KVFormat.BF16:
            keys = rows.float()
        elif self.fmt is KVFormat.FP8:
            assert kv_scale is not None
            keys = quant.dequantize_fp8(rows, kv_scale)
        else:
            assert kv_sc is not None
            packed = rows.view(torch.uint8) if rows.dtype != torch.uint8 else rows
            keys = quant.dequantize_mxfp4(packed, kv_sc[phys.reshape(-1)]).view(
                b, -1, QK_HEAD_DIM)
        keys = keys.to(self.dtype)
        qs = q.reshape(b, ql * h, QK_HEAD_DIM).to(self.dtype)
        scores = torch.matmul(qs, keys.transpose(1, 2)).float() * SM_SCALE
        j = torch.arange(ql, device=dev).repeat_interleave(h)
        limit = lens[:, None] - ql + j[None, :]  # (B, rows): last visible key per row
        seen = t[None, None, :] <= limit[:, :, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out = torch.matmul(p.to(self.dtype), keys[..., :V_HEAD_DIM]).float()
        return out.view(b * ql, h, V_HEAD_DIM).to(torch.bfloat16)


def _runs_bucket(backend: Any, rep: Shape, config: Mapping[str, Any]) -> bool:
    """Whether the family's bucket build runs `config` at the bucket's representative
    (uniform) shape. Triton's is the balanced schedule whatever the lengths, so its knobs
    (`seg_cost`) count as for a ragged shape."""
    if backend.name != "triton":
        return bool(backend.feasible(rep, config))
    from mla_tune.kernels.triton.launch import variant_feasible

    return variant_feasible(rep.kv_format.value, rep.kv_lens, rep.q_len, rep.heads,
                            rep.page_size, config, balanced=True)


def build_runner(decision: "Decision", shape: Shape, device: torch.device, *,
                 paged: bool) -> BucketRunner:
    """Build the bucket runner of `decision` for `shape` (the bucket's representative)."""
    if decision.backend == "triton":
        return _TritonBucket(decision, shape, paged, device)
    if decision.backend == "torch":
        return _TorchBucket(decision, shape, paged, device)
    raise ValueError(f"backend {decision.backend!r} has no bucket build")


# -- routing ---------------------------------------------------------------------------


class BucketRouter:
    """Bucket routing and runner cache of one Dispatcher (`router_for`)."""

    def __init__(self, dispatcher: "RoutingTable", edges: BucketEdges | None = None) -> None:
        self.d = dispatcher
        self.edges = edges or BucketEdges.from_env()
        self.builds = 0
        """Runners built so far (a serving loop's count stays flat inside a bucket)."""
        self._lock = threading.RLock()
        self._decided: dict[tuple[Bucket, bool], list["Decision"]] = {}
        self._runners: dict[tuple[Any, ...], BucketRunner] = {}
        self._task: dict[tuple[Any, ...], Any] = {}
        self._ragged_winners: dict[Bucket, Any] = {}
        for w in dispatcher._table.values():
            s = w.winner.shape
            if s.is_ragged:
                bk = bucket_of(s, self.edges)
                prev = self._ragged_winners.get(bk)
                if prev is None or w.winner.median_us < prev.winner.median_us:
                    self._ragged_winners[bk] = w

    @property
    def has_ragged_winners(self) -> bool:
        """Whether any winner was tuned on a ragged batch (else no exact ragged call can
        have one, and `Dispatcher.run(data, kv_lens=...)` goes straight to the bucket)."""
        return bool(self._ragged_winners)

    def bucket(self, batch: int, total_kv: int, q_len: int, heads: int,
               kv_format: KVFormat, page_size: int = 1) -> Bucket:
        lo, hi = self.edges.kv_class(total_kv / batch)
        return Bucket(batch, lo, hi, q_len, heads, kv_format, page_size)

    def decisions(self, bucket: Bucket, paged: bool) -> list["Decision"]:
        """Every variant a call of `bucket` may run, in the order tried (module
        docstring), each config already made length-independent."""
        key = (bucket, paged)
        got = self._decided.get(key)
        if got is not None:
            return got
        from mla_tune.runtime.routing import Decision

        d = self.d
        rep = bucket.representative()
        out: list[Decision] = []
        seen: set[tuple[str, str]] = set()

        def add(backend: str, config: Mapping[str, Any], reason: str, detail: str,
                tuned_us: float | None = None, tuned: Shape | None = None) -> None:
            cfg = bucket_config(backend, config)
            if cfg is None:
                return
            fam = d._family(backend)
            if isinstance(fam, str) or fam.backend.supports(rep) is not None \
                    or not _runs_bucket(fam.backend, rep, cfg):
                return
            # Never a variant stored wrong at the bucket's shape, as tuned or as adapted.
            trust = getattr(d, "trust", None)
            if trust is not None and (trust(backend, config, rep) is None
                                      or trust(backend, cfg, rep) is None):
                return
            k = (backend, config_key(cfg))
            if k not in seen:
                seen.add(k)
                out.append(Decision(rep, backend, cfg, reason,
                                    f"bucket {bucket.label()}: {detail}", tuned_us, tuned))

        # The bucket runner's knobs (Triton: the balanced schedule's seg_cost) can be forced.
        forced = d._forced(rep, lambda backend, c: _runs_bucket(backend, rep, c))
        if forced is not None:
            add(forced.backend, forced.config, "forced", forced.detail)
        for page in winner_pages(bucket.page_size):
            w = self._ragged_winners.get(replace(bucket, page_size=page))
            if w is not None:
                own = page == bucket.page_size
                add(w.winner.backend, w.config, "exact" if own else "nearest",
                    f"tuned on ragged batch {w.winner.shape.label()}"
                    + ("" if own else f" p{page} (the contiguous bucket's)"),
                    w.winner.median_us, w.winner.shape)
        lb, lk = math.log(rep.batch), math.log(rep.kv_len)

        def distance(w: Any) -> tuple[float, int, int]:
            s = w.winner.shape
            return (math.hypot(math.log(s.batch) - lb, math.log(s.kv_len) - lk), s.batch,
                    s.kv_len)

        for page in winner_pages(bucket.page_size):
            fam_key = (bucket.kv_format, bucket.heads, bucket.q_len, page)
            for w in sorted(d._uniform.get(fam_key, ()), key=distance):
                s = w.winner.shape
                tuned = s.label() + ("" if s.page_size > 1 else " p1")
                add(w.winner.backend, w.config, "nearest",
                    f"variant of tuned shape {tuned} (log distance "
                    f"{distance(w)[0]:.2f}, {w.winner.median_us:.1f} us there)",
                    w.winner.median_us, s)
        for fallback in (d._heuristic(rep), d._last_resort(rep)):
            if fallback is not None:
                add(fallback.backend, fallback.config, fallback.reason, fallback.detail)
        if not any(x.backend == "torch" for x in out):
            fam = d._family("torch")
            if not isinstance(fam, str):
                cands = fam.backend.candidates(rep, d.device) or [next(fam.space.grid())]
                add("torch", cands[0], "fallback", "last resort: torch family")
        self._decided[key] = out
        return out

    def runner(self, bucket: Bucket, *, paged: bool, probe: Any = None,
               cache: dict[tuple[Any, ...], BucketRunner] | None = None) -> BucketRunner:
        """The built runner of `bucket`, building it on first use. `probe(runner)` runs
        the first call (a variant whose build or first call fails falls through to the
        next); `cache` holds the runners instead of the router's own (a wrapper keeps its
        runners, whose output buffers its callers read, to itself)."""
        runners = self._runners if cache is None else cache
        key = (bucket, paged)
        r = runners.get(key)
        if r is not None:
            return r
        with self._lock:
            r = runners.get(key)
            if r is not None:
                return r
            rep = bucket.representative()
            errors: list[str] = []
            for dec in self.decisions(bucket, paged):
                # Variants with the same config share one built runner across buckets.
                share = (dec.backend, config_key(dec.config), bucket.batch, bucket.q_len,
                         bucket.heads, bucket.kv_format, bucket.page_size, paged)
                r = runners.get(share)
                try:
                    if r is None:
                        fam = self.d._family(dec.backend)
                        assert not isinstance(fam, str)
                        why = fam.backend.precheck(rep, dec.config, self.d.device)
                        if why:
                            raise RuntimeError(f"precheck: {why}")
                        r = build_runner(dec, rep, self.d.device, paged=paged)
                        self.builds += 1
                        if probe is not None:
                            probe(r)
                except Exception as e:  # noqa: BLE001 - fall through to the next variant
                    log.warning(
                        "mla-tune: %s %s failed for %s (%s: %s); trying the next fallback",
                        dec.backend, config_key(dec.config), bucket.label(),
                        type(e).__name__, e)
                    errors.append(f"{dec.backend}: {e}")
                    continue
                runners[share] = r
                runners[key] = r
                self.d._announce(dec)
                return r
        raise RuntimeError(f"mla-tune: every variant failed for bucket {bucket.label()}: "
                           + "; ".join(errors))

    # -- task tuples ------------------------------------------------------------------

    def run_task(self, data: TaskInput, kv_lens: Sequence[int] | None = None) -> torch.Tensor:
        """A task tuple whose KV holds other than `batch * kv_seq_len` rows (a ragged
        batch, lengths on the device only): run its bucket's runner. Host lengths, when
        given, are checked against the call (the kernels read them from kv_indptr)."""
        if kv_lens is not None:
            _check_lens(data, kv_lens)
        try:
            config, kv_data = data[4], data[1]
            batch = config["batch_size"]
            key = (batch, config["q_seq_len"], config["num_heads"],
                   self.edges.kv_class(_rows(kv_data) / batch)[1], tuple(kv_data))
            fn = self._task.get(key)
        except (LookupError, TypeError, ValueError, AttributeError, ZeroDivisionError):
            fn = key = None
        if fn is None:
            fn = self._task_runner(data)
            if key is not None:
                self._task[key] = fn
        return fn(data)

    def _task_runner(self, data: TaskInput) -> Any:
        """Check a ragged task tuple in full and make its hot-path closure."""
        from mla_tune.runtime.routing import _config_shape

        if not isinstance(data, (tuple, list)) or len(data) != 5:
            raise ValueError("data must be the tuple (q, kv_data, qo_indptr, kv_indptr, config)")
        q, kv_data, qo, kvp, config = data
        probe = _config_shape(config, None, KVFormat.BF16)
        if not isinstance(kv_data, Mapping) or not kv_data:
            raise ValueError("kv_data must be a non-empty dict of KV formats")
        rows = _rows(kv_data)
        b, ql, kv_max = probe.batch, probe.q_len, probe.kv_len
        if not b * ql <= rows <= b * kv_max:
            raise ValueError(
                f"kv_data holds {rows} KV rows; a batch of {b} sequences of {ql} to "
                f"{kv_max} tokens (config q_seq_len, kv_seq_len) holds {b * ql} to "
                f"{b * kv_max}")
        mean = max(ql, rows // b)
        try:
            rep_probe = Shape.uniform(b, mean, q_len=ql, heads=probe.heads)
        except ShapeError as e:
            raise ValueError(f"config: {e}") from None
        fmt = self.d.choose_format(rep_probe, kv_data)
        dev = self.d.device
        check_tensor(q, "q", [torch.bfloat16], (b * ql, probe.heads, QK_HEAD_DIM), dev, True)
        for t, n in ((qo, "qo_indptr"), (kvp, "kv_indptr")):
            check_tensor(t, n, [torch.int32], b + 1, dev)
        kv, scale, sc = split_entry(kv_data, fmt, rows, dev)
        bucket = self.bucket(b, rows, ql, probe.heads, fmt)

        def first(r: BucketRunner) -> None:
            r(q, kv, scale, sc, qo, kvp, kv_max)

        runner = self.runner(bucket, paged=False, probe=first)
        name = fmt.value
        q_shape = q.shape
        lo_rows = b * ql
        kv_dtype, kv_row = kv.dtype, kv.shape[1:]

        def run(data: TaskInput) -> torch.Tensor:
            q, kv_data, qo, kvp, config = data
            entry = kv_data[name]
            kv, aux = (entry, None) if name == "bf16" else entry
            kv_max = config["kv_seq_len"]
            if name == "mxfp4" and kv.dtype != torch.uint8:
                kv = kv.view(torch.uint8)
            if q.shape != q_shape or q.dtype is not torch.bfloat16 or q.device != dev \
                    or qo.numel() != b + 1 or kvp.numel() != b + 1 \
                    or not lo_rows <= kv.shape[0] <= b * kv_max or kv.device != dev \
                    or kv.dtype != kv_dtype or kv.shape[1:] != kv_row \
                    or not kv.is_contiguous():
                raise ValueError(f"inputs do not match bucket {bucket.label()}: q "
                                 f"{tuple(q.shape)}, qo_indptr {qo.numel()}, kv_indptr "
                                 f"{kvp.numel()} entries, KV {kv.dtype} "
                                 f"{tuple(kv.shape)}")
            if name == "bf16":
                return runner(q, kv, None, None, qo, kvp, kv_max)
            if name == "fp8":
                return runner(q, kv, aux, None, qo, kvp, kv_max)
            return runner(q, kv, None, aux, qo, kvp, kv_max)

        run.runner = runner  # type: ignore[attr-defined]  # what it runs, for reports
        return run


def _check_lens(data: Any, kv_lens: Sequence[int]) -> None:
    """Host kv lengths must describe the call: one per sequence, within the config's
    longest, summing to the KV rows."""
    try:
        batch, kv_max = data[4]["batch_size"], data[4]["kv_seq_len"]
        rows = _rows(data[1])
    except Exception:  # noqa: BLE001 - the full checks explain a malformed call
        return
    lens = list(kv_lens)
    if any(type(k) is not int for k in lens):
        raise ValueError(f"kv_lens must be ints, got {lens[:8]!r}...")
    if len(lens) != batch:
        raise ValueError(f"kv_lens has {len(lens)} lengths for batch_size {batch}")
    if max(lens) > kv_max:
        raise ValueError(f"kv_lens max {max(lens)} exceeds config kv_seq_len {kv_max}")
    if sum(lens) != rows:
        raise ValueError(f"kv_lens sum to {sum(lens)} but kv_data holds {rows} KV rows")


def _rows(kv_data: Mapping[str, Any]) -> int:
    """KV rows of the call: the first dimension of the first format's values."""
    return kv_rows(kv_data, [f.value for f in _FORMAT_ORDER])


def split_entry(kv_data: Mapping[str, Any], fmt: KVFormat, rows: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(values, fp8 scale, MXFP4 scales) of format `fmt` of a task's kv_data, checked."""
    if fmt.value not in kv_data:
        raise ValueError(f"kv_data lacks {fmt.value!r}, the format this call runs in")
    e, name = kv_data[fmt.value], f"kv_data[{fmt.value!r}]"
    if fmt is KVFormat.BF16:
        check_tensor(e, name, [torch.bfloat16], (rows, 1, QK_HEAD_DIM), device, True)
        return e, None, None
    if not isinstance(e, (tuple, list)) or len(e) != 2:
        raise ValueError(f"{name} must be a (values, scale) pair")
    if fmt is KVFormat.FP8:
        check_tensor(e[0], f"{name}[0]", FP8_DTYPES, (rows, 1, QK_HEAD_DIM), device, True)
        check_tensor(e[1], f"{name}[1]", [torch.float32], 1, device)
        return e[0], e[1], None
    check_tensor(e[0], f"{name}[0]", FP4_DTYPES, (rows, 1, FP4_PACKED_DIM), device, True)
    check_tensor(e[1], f"{name}[1]", E8M0_DTYPES, (-rows, -MXFP4_BLOCKS), device)
    packed = e[0] if e[0].dtype == torch.uint8 else e[0].view(torch.uint8)
    return packed, None, e[1]


def ragged_rows(data: Any) -> int | None:
    """The KV rows of a task tuple that can only be a ragged batch: fewer than `batch *
    kv_seq_len` rows, and at least one sequence of `kv_seq_len` (the longest, as the config
    says) plus `q_seq_len` for each other one. Else None, and the call is checked as a
    uniform one; never raises (a malformed call is explained by the full checks)."""
    try:
        c = data[4]
        rows = _rows(data[1])
        return rows if is_ragged_rows(rows, c["batch_size"], c["q_seq_len"],
                                      c["kv_seq_len"]) else None
    except Exception:  # noqa: BLE001
        return None


_ROUTERS: "weakref.WeakKeyDictionary[Any, BucketRouter]" = weakref.WeakKeyDictionary()
_ROUTERS_LOCK = threading.Lock()


def router_for(dispatcher: "RoutingTable") -> BucketRouter:
    """The bucket router of `dispatcher` (one per dispatcher, made on first use)."""
    r = _ROUTERS.get(dispatcher)
    if r is None:
        with _ROUTERS_LOCK:
            r = _ROUTERS.get(dispatcher)
            if r is None:
                r = _ROUTERS[dispatcher] = BucketRouter(dispatcher)
    return r


__all__ = ["BUCKET_BACKENDS", "Bucket", "BucketEdges", "BucketRouter", "BucketRunner",
           "DEFAULT_KV_EDGES", "KV_BUCKETS_ENV", "bucket_config", "bucket_of",
           "build_runner", "ragged_rows", "router_for", "split_entry"]
