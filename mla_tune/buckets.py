"""Length buckets: one built runner per bucket of ragged, growing decode batches.

A serving loop calls decode attention every step with new lengths. Building a variant per
tuple of lengths (what an exact-shape cache does) costs a build per step, so calls whose
lengths the host does not hold exactly are routed by a bucket instead:

    bucket = (batch, kv class of the mean length, q_len, heads, KV format, page size)

- batch is exact: the kernels' grid is (row blocks, splits, batch) and the output and split
  buffers are sized by it (servers pad their batch to a few sizes already, as they do for
  CUDA graphs);
- the kv class is the smallest edge >= the mean kv length, on a log scale: by default the
  powers of two 64 .. 1048576 (`DEFAULT_KV_EDGES`). Edges are configurable with
  `MLA_TUNE_KV_BUCKETS="256,1024,4096,..."` or `BucketEdges(...)`. A class is routed as
  the uniform batch at the geometric middle of its range (`Bucket.representative`).

Everything that defines a bucket is host-visible without reading device memory: batch from
the config (or `qo_indptr`'s length), the mean from the number of KV tokens (the KV
tensor's first dimension, or the host-side lengths or page count of a paged call). Routing
therefore never synchronizes and is the same on every rank.

A bucket runner reads each sequence's length from `kv_indptr` on the device, and the split
schedule (which program reads which KV range, how many partials each sequence merges) is
computed there from it (`_split_bounds` in kernels/triton/mla_decode.py), so one runner
serves every length of its bucket with no rebuild, recompile or allocation, and a call is
capturable in a CUDA graph. Variant choice per bucket, first that builds:
0. `MLA_TUNE_FORCE`, where feasible;
1. a winner tuned on a ragged batch of this bucket;
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

import bisect
import logging
import math
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mla_tune.problem import (
    QK_HEAD_DIM,
    SM_SCALE,
    V_HEAD_DIM,
    KVFormat,
    Shape,
    ShapeError,
    TaskInput,
)
from mla_tune.space import config_key

if TYPE_CHECKING:
    from mla_tune.dispatch import Decision, Dispatcher

log = logging.getLogger(__name__)

KV_BUCKETS_ENV = "MLA_TUNE_KV_BUCKETS"
DEFAULT_KV_EDGES = tuple(2 ** k for k in range(6, 21))
BUCKET_BACKENDS = ("triton", "torch")
"""Families with a bucket build (a runner that reads lengths on the device)."""
_FORMAT_ORDER = (KVFormat.BF16, KVFormat.FP8, KVFormat.MXFP4)


@dataclass(frozen=True)
class BucketEdges:
    """Upper edges of the kv classes (of the mean kv length), ascending."""

    kv: tuple[int, ...] = DEFAULT_KV_EDGES

    def __post_init__(self) -> None:
        edges = tuple(int(e) for e in self.kv)
        if not edges or any(e < 1 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"kv bucket edges must be ascending positive ints, got {self.kv}")
        object.__setattr__(self, "kv", edges)

    @classmethod
    def parse(cls, text: str) -> "BucketEdges":
        """`"256,1024,4096"` -> edges; what `MLA_TUNE_KV_BUCKETS` holds."""
        try:
            return cls(tuple(int(p) for p in text.replace(" ", "").split(",") if p))
        except ValueError as e:
            raise ValueError(f"{KV_BUCKETS_ENV}: {e}; expected ascending ints like "
                             f"'256,1024,4096'") from None

    @classmethod
    def from_env(cls) -> "BucketEdges":
        text = os.environ.get(KV_BUCKETS_ENV, "").strip()
        return cls.parse(text) if text else cls()

    def kv_class(self, mean_kv: float) -> tuple[int, int]:
        """(lower edge exclusive, upper edge inclusive) of the class holding `mean_kv`;
        past the last edge, classes keep doubling."""
        i = bisect.bisect_left(self.kv, math.ceil(mean_kv))
        if i < len(self.kv):
            return (self.kv[i - 1] if i else 0), self.kv[i]
        hi = self.kv[-1]
        while hi < mean_kv:
            hi *= 2
        return hi // 2, hi


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
        lo = self.kv_lo if self.kv_lo > 0 else max(self.kv_hi // 2, 1)
        return max(self.q_len, round(math.sqrt(lo * self.kv_hi)))

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


def bucket_config(backend: str, config: Mapping[str, Any], *,
                  paged: bool) -> dict[str, Any] | None:
    """`config` made independent of the lengths (module docstring), or None when the
    family has no bucket build."""
    if backend not in BUCKET_BACKENDS:
        return None
    out = dict(config)
    if backend == "triton":
        if paged:
            out["kv_load"] = "pointer"
        elif out.get("kv_load") == "tma_host":
            out["kv_load"] = "tma"
        # Contiguous: direct rows (a page table from the knob would fix the lengths);
        # paged: the call's own page size, which the shape carries.
        out["page_size"] = 1
    return out


# -- runners ---------------------------------------------------------------------------


class BucketRunner(ABC):
    """A built variant serving any lengths of its bucket: `(q, kv, kv_scale, kv_sc,
    qo_indptr, kv_indptr, max_len) -> out`. `kv_indptr` is cumulative tokens; a paged
    runner reads pages through `page_rows` (first cache row of each page) and
    `page_indptr`, buffers it owns and its caller fills (`MLADecodeWrapper.plan`).
    `max_len` is a host bound on the longest sequence (the torch build pads to it; the
    Triton build ignores it). Returns the runner's own output buffer."""

    def __init__(self, decision: "Decision", batch: int, q_len: int, heads: int,
                 paged: bool, page_capacity: int, device: torch.device) -> None:
        self.decision = decision
        self.batch, self.q_len, self.heads = batch, q_len, heads
        self.paged = paged
        self.page_capacity = page_capacity
        self.page_rows: torch.Tensor | None = None
        self.page_indptr: torch.Tensor | None = None
        if paged:
            self.page_rows = torch.zeros(max(page_capacity, 1), dtype=torch.int32,
                                         device=device)
            self.page_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)

    @abstractmethod
    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, max_len: int) -> torch.Tensor:
        """Decode attention of one call (class docstring)."""


class _TritonBucket(BucketRunner):
    """The Triton family's launcher built once for the bucket's representative shape; its
    kernels take every length from `kv_indptr` on the device."""

    def __init__(self, decision: "Decision", shape: Shape, paged: bool, page_capacity: int,
                 device: torch.device) -> None:
        super().__init__(decision, shape.batch, shape.q_len, shape.heads, paged,
                         page_capacity, device)
        from kernels.triton.mla_decode import MlaDecodeLauncher
        from mla_tune.backends.triton_family import kernel_config

        cfg = kernel_config(shape, decision.config)
        table = (self.page_rows, self.page_indptr) if paged else None
        self.launcher = MlaDecodeLauncher(cfg, heads=shape.heads, q_len=shape.q_len,
                                          kv_lens=list(shape.kv_lens), device=device,
                                          sm_scale=SM_SCALE, page_table=table)
        # Any MXFP4 scale row stride works: it is a runtime argument of the kernel.
        self.launcher.prepare(sc_stride=24 if shape.kv_format is KVFormat.MXFP4 else 0)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, max_len: int) -> torch.Tensor:
        return self.launcher(q, kv, kv_scale, kv_sc, qo_indptr, kv_indptr)


class _TorchBucket(BucketRunner):
    """The torch family's bucket build: one gather of every sequence's keys padded to
    `max_len` (through the page table when paged), a causal/length mask built from
    `kv_indptr` on the device, one softmax. Slow but exact and everywhere; the CPU path."""

    def __init__(self, decision: "Decision", shape: Shape, paged: bool, page_capacity: int,
                 device: torch.device) -> None:
        super().__init__(decision, shape.batch, shape.q_len, shape.heads, paged,
                         page_capacity, device)
        self.fmt = shape.kv_format
        self.page_shift = shape.page_size.bit_length() - 1
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}
        self.dtype = names.get(str(decision.config.get("compute_dtype", "float32")),
                               torch.float32)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor | None,
                 kv_sc: torch.Tensor | None, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, max_len: int) -> torch.Tensor:
        from mla_tune import quant

        dev = q.device
        b, ql, h = self.batch, self.q_len, self.heads
        width = kv.shape[-1]
        flat = kv.reshape(-1, width)
        n_rows = flat.shape[0]
        kvp = kv_indptr.to(torch.long)
        lens = kvp[1:] - kvp[:-1]
        t = torch.arange(max(int(max_len), 1), device=dev)
        if self.paged:
            assert self.page_rows is not None and self.page_indptr is not None
            slot = self.page_indptr[:-1].to(torch.long)[:, None] + (t >> self.page_shift)
            slot = slot.clamp(0, self.page_rows.numel() - 1)
            phys = self.page_rows.to(torch.long)[slot] + (t & ((1 << self.page_shift) - 1))
        else:
            phys = kvp[:-1, None] + t[None, :]
        valid = t[None, :] < lens[:, None]
        phys = torch.where(valid, phys, torch.zeros_like(phys)).clamp(0, n_rows - 1)
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


def build_runner(decision: "Decision", shape: Shape, device: torch.device, *, paged: bool,
                 page_capacity: int = 0) -> BucketRunner:
    """Build the bucket runner of `decision` for `shape` (the bucket's representative)."""
    if decision.backend == "triton":
        return _TritonBucket(decision, shape, paged, page_capacity, device)
    if decision.backend == "torch":
        return _TorchBucket(decision, shape, paged, page_capacity, device)
    raise ValueError(f"backend {decision.backend!r} has no bucket build")


# -- routing ---------------------------------------------------------------------------


class BucketRouter:
    """Bucket routing and runner cache of one Dispatcher (`router_for`)."""

    def __init__(self, dispatcher: "Dispatcher", edges: BucketEdges | None = None) -> None:
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
            s = w.record.shape
            if s.is_ragged:
                bk = bucket_of(s, self.edges)
                prev = self._ragged_winners.get(bk)
                if prev is None or w.record.median_us < prev.record.median_us:
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
        from mla_tune.dispatch import Decision

        d = self.d
        rep = bucket.representative()
        out: list[Decision] = []
        seen: set[tuple[str, str]] = set()

        def add(backend: str, config: Mapping[str, Any], reason: str, detail: str,
                tuned_us: float | None = None, tuned: Shape | None = None) -> None:
            cfg = bucket_config(backend, config, paged=paged)
            if cfg is None:
                return
            fam = d._family(backend)
            if isinstance(fam, str) or fam.backend.supports(rep) is not None \
                    or not fam.backend.feasible(rep, cfg):
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

        forced = d._forced(rep)
        if forced is not None:
            add(forced.backend, forced.config, "forced", forced.detail)
        w = self._ragged_winners.get(bucket)
        if w is not None:
            add(w.record.backend, w.config, "exact",
                f"tuned on ragged batch {w.record.shape.label()}", w.record.median_us,
                w.record.shape)
        lb, lk = math.log(rep.batch), math.log(rep.kv_len)

        def distance(w: Any) -> tuple[float, int, int]:
            s = w.record.shape
            return (math.hypot(math.log(s.batch) - lb, math.log(s.kv_len) - lk), s.batch,
                    s.kv_len)

        for page in dict.fromkeys((bucket.page_size, 1)):
            fam_key = (bucket.kv_format, bucket.heads, bucket.q_len, page)
            for w in sorted(d._uniform.get(fam_key, ()), key=distance):
                s = w.record.shape
                add(w.record.backend, w.config, "nearest",
                    f"variant of tuned shape {s.label()} p{s.page_size} (log distance "
                    f"{distance(w)[0]:.2f}, {w.record.median_us:.1f} us there)",
                    w.record.median_us, s)
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

    def runner(self, bucket: Bucket, *, paged: bool, page_capacity: int = 0,
               probe: Any = None, cache: dict[tuple[Any, ...], BucketRunner] | None = None
               ) -> BucketRunner:
        """The built runner of `bucket`, building it on first use. `probe(runner)` runs
        the first call (a variant whose build or first call fails falls through to the
        next); `cache` holds the runners instead of the router's own (a wrapper keeps
        its paged runners, whose page buffers it fills, to itself)."""
        runners = self._runners if cache is None else cache
        key = (bucket, paged, page_capacity)
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
                         bucket.heads, bucket.kv_format, bucket.page_size, paged,
                         page_capacity)
                r = runners.get(share)
                try:
                    if r is None:
                        fam = self.d._family(dec.backend)
                        assert not isinstance(fam, str)
                        why = fam.backend.precheck(rep, dec.config, self.d.device)
                        if why:
                            raise RuntimeError(f"precheck: {why}")
                        r = build_runner(dec, rep, self.d.device, paged=paged,
                                         page_capacity=page_capacity)
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
        from mla_tune.dispatch import _config_shape, _check_tensor

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
        _check_tensor(q, "q", [torch.bfloat16], (b * ql, probe.heads, QK_HEAD_DIM), dev, True)
        for t, n in ((qo, "qo_indptr"), (kvp, "kv_indptr")):
            _check_tensor(t, n, [torch.int32], b + 1, dev)
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
    for f in _FORMAT_ORDER:
        if f.value in kv_data:
            e = kv_data[f.value]
            return int((e if isinstance(e, torch.Tensor) else e[0]).shape[0])
    raise ValueError(f"kv_data holds none of {[f.value for f in _FORMAT_ORDER]}")


def split_entry(kv_data: Mapping[str, Any], fmt: KVFormat, rows: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(values, fp8 scale, MXFP4 scales) of format `fmt` of a task's kv_data, checked."""
    from mla_tune.dispatch import (
        _E8M0_DTYPES,
        _FP4_DTYPES,
        _FP8_DTYPES,
        FP4_PACKED_DIM,
        MXFP4_BLOCKS,
        _check_tensor,
    )

    if fmt.value not in kv_data:
        raise ValueError(f"kv_data lacks {fmt.value!r}, the format this call runs in")
    e, name = kv_data[fmt.value], f"kv_data[{fmt.value!r}]"
    if fmt is KVFormat.BF16:
        _check_tensor(e, name, [torch.bfloat16], (rows, 1, QK_HEAD_DIM), device, True)
        return e, None, None
    if not isinstance(e, (tuple, list)) or len(e) != 2:
        raise ValueError(f"{name} must be a (values, scale) pair")
    if fmt is KVFormat.FP8:
        _check_tensor(e[0], f"{name}[0]", _FP8_DTYPES, (rows, 1, QK_HEAD_DIM), device, True)
        _check_tensor(e[1], f"{name}[1]", [torch.float32], 1, device)
        return e[0], e[1], None
    _check_tensor(e[0], f"{name}[0]", _FP4_DTYPES, (rows, 1, FP4_PACKED_DIM), device, True)
    _check_tensor(e[1], f"{name}[1]", _E8M0_DTYPES, (-rows, -MXFP4_BLOCKS), device)
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
        b, ql, kv_max = c["batch_size"], c["q_seq_len"], c["kv_seq_len"]
        return rows if kv_max + (b - 1) * ql <= rows < b * kv_max else None
    except Exception:  # noqa: BLE001
        return None


_ROUTERS: "weakref.WeakKeyDictionary[Any, BucketRouter]" = weakref.WeakKeyDictionary()
_ROUTERS_LOCK = threading.Lock()


def router_for(dispatcher: "Dispatcher") -> BucketRouter:
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
