"""The dispatcher: run the tuned kernel for each call with no search, no DB access and, after
a shape's first call, nothing on the hot path but one dict lookup, the input checks and the
cached kernel.

Loading (once). A table of winners comes from the tuning DB (`Dispatcher.from_db`; with
no DB named, the user's ./tuning.db if it exists layered over the winners shipped with
mla-tune), a winners JSON file (`Dispatcher.from_json`, see `winners_json.py`) or a list of
records. Each record carries where its config was verified ok / stored wrong (a DB's
trials, a file's `verified_ok`/`verified_wrong`); they are indexed once, at load.
Loading never runs anything from the table. A winner is
- ignored when it was tuned on another device model (device fingerprint differs) or for
  kernel sources that no longer exist (its source hash is not the installed backend's;
  one warning per load counts those of this device, which `mla-tune doctor` names);
- skipped with a warning when it names a backend unknown or unavailable here, or a config
  outside that backend's declared space;
- used with a one-time warning when it was tuned under other library versions
  (python/torch/triton/FlashInfer/aiter), or ignored under `strict=True`.
Of several usable winners for one shape, the one from this exact stack wins, then the
fastest. A missing or corrupt DB or file is a warning: the heuristics below then route
every call. A serving process never crashes because of the tuning DB.

Routing a call (once per shape key; the key is `(batch_size, q_seq_len, kv_seq_len,
num_heads)` from the task's `config`, so no indptr is read and nothing synchronizes):
0. `MLA_TUNE_FORCE="backend:key=value,..."` forces a variant wherever it is feasible
   (parameters left out take the backend's first feasible choice);
1. the tuned winner of the exact shape;
2. else a variant moved from the nearest tuned uniform shape with the same KV format and
   page size, of any q_len/heads family, by distance over (log batch, log kv length, log
   rows per sequence), the call's own family first on ties ("nearest" when the shape is
   of the call's family, else "transfer"). For a row-blocked family (a `block_m` knob:
   Triton) the row model (mla_tune/runtime/routing_rules.py) re-derives the row knobs: `block_m`
   the largest block the call's q_len x heads rows fill (kept, or capped, by the tuned
   shape's own choice), the split count the occupancy model's for this call scaled by the
   tuned shape's measured count over the model's there; every other knob as tuned where
   the call's feasible candidates allow (up to `TRANSFER_TRIES` variants, best first); a
   library that plans its own rows serves the call with its config as tuned, before the
   moved variants where the wins around the call favour it (`library_preferred`). A
   variant of the call's family verified at this very shape comes first, as tuned;
3. then the nearest tuned shape of the call's family (format, heads, q_len, page size) by
   distance over (log batch, log kv length), ties to the smaller shape, its variant as
   tuned (the only step 2 for families the row model does not describe); none stored
   wrong anywhere in that family (suspect); the decision says when the variant was never
   verified at this shape;
4. else the row model alone (the heuristic) on the first available family of
   `HEURISTIC_BACKENDS`: the block the rows fill, `occupancy_splits` over its row blocks;
5. else the torch family with the first feasible config of its space.
A variant that fails its backend's precheck, its build or its first call falls through to
the next step. No step ever runs a variant stored wrong for the call's exact shape.
Fallbacks are logged once per key (nearest: INFO; transfer, heuristic and torch: WARNING);
`MLA_TUNE_TRACE=1` prints every routing decision once per key to stderr. Routing depends
only on the loaded table, the call's shape and the device model, never on timing or GPU
index, so every rank of a job runs the same variants (a variant that fails on one rank is
the only exception).

KV format. The task's `kv_data` holds several formats; unless `kv_format=` pins one, each
shape runs in the format, among those present in the call, with the fastest tuned winner
for the exact shape. Without an exact winner in any present format, the nearest tuned
shapes' medians are compared (those of the call's family before those of other
families), scaled by the ratio of KV tokens (decode is memory-bound); formats without
tuned data come last, in the order bf16, fp8, mxfp4.

Ragged batches. The config gives only the longest kv length and the lengths live on the
device. A task tuple whose KV holds fewer than `batch * kv_seq_len` rows (and at least the
longest sequence plus `q_seq_len` per other one) is a ragged call and runs its length
bucket's runner (mla_tune/runtime/buckets.py): routed from the batch and the mean length (KV rows
/ batch) only, built once per bucket, reading the lengths from `kv_indptr` on the device,
so a growing serving loop builds nothing after each bucket's first call and a call is
capturable in a CUDA graph. `run(data, kv_lens=[...])` checks the host lengths against the
call and takes the same bucket; only where winners tuned on ragged batches were loaded does
it look for the exact ragged winner first (built per lengths tuple, the last
`RAGGED_CACHE`). Paged KV pools: `MLADecodeWrapper` (mla_tune/runtime/wrapper.py).

Hot path. Per call: the key lookup, dtype/shape/device/contiguity checks and the config's
fixed fields and `sm_scale` (a wrong input raises ValueError naming the argument, before
any launch, exactly as on a first call) and the kernel. The tensor checks are
most of the dispatcher's cost (14 tensor-metadata reads: the dispatcher adds 3.75 us per
call with them and 0.60 us without on the H200 host, bench/results/dispatch_overhead.md);
`check_inputs=False` keeps them for a key's first call
only, for callers that guarantee every later call matches its config and holds the same
KV formats (and KV rows: a ragged call of a config first called uniform would run the
uniform route unchecked). The dispatcher allocates no device memory per call and never synchronizes;
output and split buffers are the backend's, prepared in `build` (the Triton family
preallocates them, so a call is capturable in a CUDA graph once the shape has been called
eagerly). Building is serialized by a lock; lookups take none. A built variant may reuse
its output tensor across calls (the Triton family does): copy an output you keep past the
next call of the same shape, and do not call one shape from two threads or streams at
once. Uniform keys are exact shapes; ragged calls go by length bucket (above).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from mla_tune.backends import get_backend
from mla_tune.machine.fingerprint import (
    current_device,
)
from mla_tune.problem.shapes import QK_HEAD_DIM, KVFormat, Shape, TaskInput
from mla_tune.results.winner import Winner
from mla_tune.results.winners_file import load_winners_json
from mla_tune.runtime.input_checks import (
    E8M0_DTYPES,
    FP4_DTYPES,
    FP4_PACKED_DIM,
    FP8_DTYPES,
    MXFP4_BLOCKS,
    TASK_FIXED_FIELDS,
    check_config,
    check_sizes,
    check_task_tensors,
    check_tensor,
)
from mla_tune.runtime.routing import (
    FORMAT_ORDER,
    Decision,
    RoutingTable,
    _config_shape,
    _default_device,
)
from mla_tune.runtime.routing_rules import (
    CALL_KEY_FIELDS,
    occupancy_splits,
)
from mla_tune.tuning.space import config_key

log = logging.getLogger(__name__)

TRACE_ENV = "MLA_TUNE_TRACE"
RAGGED_CACHE = 64
_FP8_DTYPES, _FP4_DTYPES, _E8M0_DTYPES = FP8_DTYPES, FP4_DTYPES, E8M0_DTYPES
_KEY_FIELDS = CALL_KEY_FIELDS
_FIXED_FIELDS = TASK_FIXED_FIELDS
# The input checks are shared with the exported submission (mla_tune/runtime/input_checks.py).
_config_values, _sizes_match, _check_tensor = check_config, check_sizes, check_tensor

Runner = Callable[[TaskInput], torch.Tensor]





















def validate_inputs(data: Any, shape: Shape, device: torch.device) -> None:
    """Validate a call against `shape` and `device`, raising ValueError that names the
    offending argument; the slow, explicit twin of the runners' fast checks."""
    check_task_tensors(data, shape.batch, shape.q_len, shape.heads, shape.total_kv,
                       shape.kv_format.value, device)


def _make_runner(fn: Runner, shape: Shape, device: torch.device, config: Mapping[str, Any],
                 on_mismatch: Callable[[TaskInput, Shape, Runner], torch.Tensor]) -> Runner:
    """The per-key hot path: cheap checks against precomputed expectations (the tensors,
    and the fields of `config`, the first call's checked config), then `fn`. Anything
    unexpected goes to `on_mismatch`, which re-routes, runs `fn` or raises ValueError."""
    # The key fields matched already: the runner was found by them.
    want = {f: config[f] for f in (*_FIXED_FIELDS, "sm_scale")}.items()
    fmt = shape.kv_format
    name = fmt.value
    code = FORMAT_ORDER.index(fmt)
    q_shape = torch.Size((shape.total_q, shape.heads, QK_HEAD_DIM))
    kv_shape = torch.Size((shape.total_kv, 1,
                           FP4_PACKED_DIM if fmt is KVFormat.MXFP4 else QK_HEAD_DIM))
    rows, n_ptr = shape.total_kv, shape.batch + 1
    bf16, i32, f32 = torch.bfloat16, torch.int32, torch.float32
    fp8s, fp4s, e8m0s = _FP8_DTYPES, _FP4_DTYPES, _E8M0_DTYPES

    def run(data: TaskInput) -> torch.Tensor:
        try:
            q, kv_data, qo, kvp, cfg = data
            entry = kv_data[name]
            if code == 0:
                kv = entry
                ok = kv.dtype is bf16
            else:
                kv, sc = entry
                if code == 1:
                    ok = (kv.dtype in fp8s and sc.dtype is f32 and sc.numel() == 1
                          and sc.device == device)
                else:
                    ok = (kv.dtype in fp4s and sc.dtype in e8m0s and sc.dim() == 2
                          and sc.shape[0] >= rows and sc.shape[1] >= MXFP4_BLOCKS
                          and sc.device == device)
            ok = (ok and kv.shape == kv_shape and kv.device == device and kv.is_contiguous()
                  and q.dtype is bf16 and q.shape == q_shape and q.device == device
                  and q.is_contiguous()
                  and qo.dtype is i32 and qo.numel() == n_ptr and qo.device == device
                  and kvp.dtype is i32 and kvp.numel() == n_ptr and kvp.device == device
                  and want <= cfg.items())
        except Exception:  # noqa: BLE001 - any malformed input is explained by on_mismatch
            ok = False
        return fn(data) if ok else on_mismatch(data, shape, fn)

    return run


class Dispatcher(RoutingTable):
    """Routes each MLA decode call to its tuned variant (module docstring: the policy)."""

    def __init__(self, winners: Iterable[Winner] = (),
                 device: str | torch.device | None = None, *,
                 kv_format: KVFormat | str | None = None, strict: bool = False,
                 check_inputs: bool = True, origin: str = "an in-memory table") -> None:
        super().__init__(winners, device, kv_format=kv_format, strict=strict, origin=origin)
        self.check_inputs = check_inputs
        self._trace = os.environ.get(TRACE_ENV, "").strip() not in ("", "0")
        self._routes: dict[tuple[Any, ...], Runner] = {}
        self._other: dict[tuple[Any, ...], Runner] = {}
        self._ragged: OrderedDict[tuple[Any, ...], Runner] = OrderedDict()
        self._lock = threading.RLock()

    # -- loading ----------------------------------------------------------------------

    @classmethod
    def from_db(cls, url_or_path: str | Sequence[str] | None = None,
                device: str | torch.device | None = None,
                *, kv_format: KVFormat | str | None = None, strict: bool = False,
                check_inputs: bool = True) -> "Dispatcher":
        """Load the tuning DB's winners once (this device's are kept: module docstring).
        Without `url_or_path` and $MLA_TUNE_DB, the user's ./tuning.db (when it exists) and
        the winners shipped with mla-tune are layered: records of both, ranked as usual;
        so are the DBs of a sequence `url_or_path` (e.g. a new sweep's and "shipped").
        A DB is opened read-only (`TuningStore(read_only=True)`): never created, migrated
        or locked. A missing, unreadable, corrupt or other-schema DB (or no SQLAlchemy
        installed) is a warning, never an error; so is a winner row that does not decode
        (that row is skipped, not the table)."""
        dev = _default_device(device)
        here = current_device(dev).hash
        sources: list[str | None] = ([url_or_path] if url_or_path is None
                                     or isinstance(url_or_path, str) else list(url_or_path))
        if not url_or_path:
            try:
                from mla_tune.db import default_db_path, shipped_db_url

                local = default_db_path()
                if local is not None:  # no DB named anywhere: local (if any) + shipped
                    sources = [None] if local.exists() else []
                    sources.append(shipped_db_url())
            except Exception as e:  # noqa: BLE001 - serving must never fail on the tuning DB
                log.warning("mla-tune: the shipped tuning results cannot be located (%s)", e)
        records: list[Winner] = []
        origins: list[str] = []
        for source in sources:
            origin = "no tuning DB"
            try:
                from mla_tune.db import TuningStore, resolve_url
                from mla_tune.results.winners_file import records_from_store

                url = resolve_url(source)
                origin = url.render_as_string(hide_password=True)
                origins.append(origin)
                # Read-only: nothing created or migrated, no write lock taken or waited for.
                with TuningStore(url.render_as_string(hide_password=False),
                                 read_only=True) as store:
                    # All devices, so summary() can say what was ignored.
                    records.extend(records_from_store(store, warn=_log_warning,
                                                      verified_for=here))
            except Exception as e:  # noqa: BLE001 - serving must never fail on the tuning DB
                log.warning("mla-tune: tuning DB %s unusable (%s); routing by heuristics",
                            origin, e)
        return cls(records, dev, kv_format=kv_format, strict=strict,
                   check_inputs=check_inputs, origin=" + ".join(origins) or "no tuning DB")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], device: str | torch.device | None = None,
                  *, kv_format: KVFormat | str | None = None, strict: bool = False,
                  check_inputs: bool = True) -> "Dispatcher":
        """Load winners from a winners JSON file (`winners_json.py`); a missing or invalid
        file is a warning and the heuristics route every call."""
        records: list[Winner] = []
        try:
            records = load_winners_json(path)
        except Exception as e:  # noqa: BLE001 - serving must never fail on a winners file
            log.warning("mla-tune: winners file %s unusable (%s: %.200s); routing by "
                        "heuristics", path, type(e).__name__, e)
        return cls(records, device, kv_format=kv_format, strict=strict,
                   check_inputs=check_inputs, origin=str(path))









    # -- routing ----------------------------------------------------------------------












    # -- calls ------------------------------------------------------------------------

    def run(self, data: TaskInput, kv_lens: Sequence[int] | None = None) -> torch.Tensor:
        """Run the call `data = (q, kv_data, qo_indptr, kv_indptr, config)`; pass the host
        kv lengths as `kv_lens` for a ragged batch."""
        if kv_lens is None:
            try:
                c = data[4]
                runner = self._routes[(c["batch_size"], c["q_seq_len"], c["kv_seq_len"],
                                       c["num_heads"])]
            except (LookupError, TypeError):
                return self._first_call(data, None, self._routes)
            return runner(data)
        return self._run_ragged(data, kv_lens)

    def __call__(self, q: torch.Tensor, kv_data: dict[str, Any], qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, config: dict[str, Any],
                 kv_lens: Sequence[int] | None = None) -> torch.Tensor:
        """Same as `run((q, kv_data, qo_indptr, kv_indptr, config), kv_lens)`."""
        return self.run((q, kv_data, qo_indptr, kv_indptr, config), kv_lens)

    def _run_ragged(self, data: TaskInput, kv_lens: Sequence[int]) -> torch.Tensor:
        lens = tuple(kv_lens)
        if len(set(lens)) == 1 and isinstance(data, (tuple, list)) and len(data) == 5 \
                and isinstance(data[4], Mapping) and data[4].get("kv_seq_len") == lens[0]:
            return self.run(data)
        from mla_tune.runtime.buckets import router_for

        router = router_for(self)
        if not router.has_ragged_winners:  # no exact ragged winner can exist: the bucket
            return router.run_task(data, lens)
        key = ("ragged", lens) + tuple(_config_field(data, f) for f in _KEY_FIELDS)
        with self._lock:
            runner = self._ragged.get(key)
            if runner is not None:
                self._ragged.move_to_end(key)
        if runner is None:
            return self._first_call(data, lens, self._ragged, key)
        return runner(data)

    def _mismatch(self, data: TaskInput, shape: Shape, fn: Runner) -> torch.Tensor:
        """A cached runner's checks failed: re-route if the call only lacks the chosen
        format, run `fn` if the config only differs in form (a float's last bit, a dict
        type), else raise ValueError naming the bad argument, as a first call would."""
        kv_data = data[1] if isinstance(data, (tuple, list)) and len(data) == 5 else None
        if self.kv_format is None and isinstance(kv_data, Mapping) \
                and shape.kv_format.value not in kv_data:
            key = ("formats", tuple(sorted(map(str, kv_data)))) + tuple(
                _config_field(data, f) for f in _KEY_FIELDS)
            runner = self._other.get(key)
            if runner is not None:
                return runner(data)
            return self._first_call(data, shape.kv_lens if shape.is_ragged else None,
                                    self._other, key)
        from mla_tune.runtime.buckets import ragged_rows, router_for

        if not shape.is_ragged and ragged_rows(data) is not None:
            return router_for(self).run_task(data)
        validate_inputs(data, shape, self.device)
        _config_values(data[4])
        return fn(data)

    def _first_call(self, data: TaskInput, kv_lens: tuple[int, ...] | None,
                    cache: dict[tuple[Any, ...], Runner],
                    key: tuple[Any, ...] | None = None) -> torch.Tensor:
        """Route, build and run a key's first call; later calls take the cached runner."""
        if not isinstance(data, (tuple, list)) or len(data) != 5:
            raise ValueError("data must be the tuple (q, kv_data, qo_indptr, kv_indptr, config)")
        _sizes_match(data, _config_values(data[4]))  # before anything is built from it
        if kv_lens is None and cache is self._routes:
            from mla_tune.runtime.buckets import ragged_rows, router_for

            if ragged_rows(data) is not None:  # lengths on the device only: its bucket
                return router_for(self).run_task(data)
        config = data[4]
        probe = _config_shape(config, kv_lens, KVFormat.BF16)
        if not isinstance(data[1], Mapping):
            raise ValueError(f"kv_data must be a dict, got {type(data[1]).__name__}")
        shape = probe.with_format(self.choose_format(probe, data[1]))
        validate_inputs(data, shape, self.device)
        if key is None:
            key = tuple(config[f] for f in _KEY_FIELDS)
        with self._lock:
            runner = cache.get(key)
            if runner is not None:
                return runner(data)
            for d in self.decisions(shape):
                try:
                    backend = get_backend(d.backend)
                    why = backend.precheck(shape, d.config, self.device)
                    if why:
                        raise RuntimeError(f"precheck: {why}")
                    fn = backend.build(shape, d.config, self.device)
                    runner = (_make_runner(fn, shape, self.device, config, self._mismatch)
                              if self.check_inputs else fn)
                    out = runner(data)
                except Exception as e:  # noqa: BLE001 - fall through to the next variant
                    log.warning("mla-tune: %s %s failed for %s (%s: %s); trying the next "
                                "fallback", d.backend, config_key(d.config), shape.key,
                                type(e).__name__, e)
                    continue
                self._announce(d)
                cache[key] = runner
                if cache is self._ragged and len(cache) > RAGGED_CACHE:
                    self._ragged.popitem(last=False)
                return out
        raise RuntimeError(f"mla-tune: every variant failed for {shape.key}")

    def _announce(self, d: Decision) -> None:
        if self._trace:
            print(f"mla-tune route: {d.describe()}", file=sys.stderr, flush=True)
        if d.reason == "nearest":
            log.info("mla-tune: %s", d.describe())
        elif d.reason in ("transfer", "heuristic", "fallback"):
            log.warning("mla-tune: %s", d.describe())


def _log_warning(message: str) -> None:
    log.warning("%s", message)


def _config_field(data: Any, field: str) -> Any:
    """`data[4][field]`, or None when the call is malformed (validated later)."""
    try:
        return data[4][field]
    except (LookupError, TypeError):
        return None


__all__ = ["Decision", "Dispatcher", "occupancy_splits", "validate_inputs"]
