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
  kernel sources that no longer exist (its source hash is not the installed backend's);
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
   the call's feasible candidates allow (up to `TRANSFER_TRIES` variants, best first). A
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
from dataclasses import dataclass
from typing import Any

import torch

from mla_tune.backends import Backend, get_backend
from mla_tune.machine.fingerprint import (
    CORE_PACKAGES,
    current_device,
    current_software,
    software_diff,
)
from mla_tune.problem.shapes import QK_HEAD_DIM, KVFormat, Shape, ShapeError, TaskInput
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
from mla_tune.runtime.routing_rules import (
    CALL_KEY_FIELDS,
    ROW_BLOCK_KNOB,
    distinct_variants,
    format_rank,
    model_knobs,
    model_ranking,
    nearest_distance,
    occupancy_splits,
    transfer_distance,
    trust_tier,
)
from mla_tune.tuning.space import ConfigError, ParamSpace, config_key

log = logging.getLogger(__name__)

FORCE_ENV = "MLA_TUNE_FORCE"
TRACE_ENV = "MLA_TUNE_TRACE"
HEURISTIC_BACKENDS = ("triton", "torch")
LAST_RESORT = "torch"
FORMAT_ORDER = (KVFormat.BF16, KVFormat.FP8, KVFormat.MXFP4)
RAGGED_CACHE = 64
TRANSFER_TRIES = 3
"""Variants a moved tuned shape offers (best first), so one the precheck prunes (a spill
the shape arithmetic cannot see) falls to the next moved variant, not the heuristic."""
_FP8_DTYPES, _FP4_DTYPES, _E8M0_DTYPES = FP8_DTYPES, FP4_DTYPES, E8M0_DTYPES
_KEY_FIELDS = CALL_KEY_FIELDS
_FIXED_FIELDS = TASK_FIXED_FIELDS
# The input checks are shared with the exported submission (mla_tune/runtime/input_checks.py).
_config_values, _sizes_match, _check_tensor = check_config, check_sizes, check_tensor

Runner = Callable[[TaskInput], torch.Tensor]


@dataclass(frozen=True)
class Decision:
    """One routing choice and why: what `mla-tune route` prints and the trace logs."""

    shape: Shape
    backend: str
    config: dict[str, Any]
    reason: str  # forced | exact | nearest | transfer | heuristic | fallback
    detail: str
    tuned_us: float | None = None
    tuned_shape: Shape | None = None

    def describe(self) -> str:
        return (f"{self.shape.key} -> {self.backend} {config_key(self.config)} "
                f"[{self.reason}] {self.detail}")


@dataclass(frozen=True)
class _Loaded:
    """A winner as the dispatcher holds it: the record, its config as its backend's space
    validated it, and how its stack differs from this one."""

    winner: Winner
    config: dict[str, Any]
    stack_diff: tuple[str, ...]


@dataclass
class _Checks:
    """Where one config of one backend (installed sources, this device) was checked
    against the reference: shape keys it matched at, shapes it was stored wrong at, and one
    wrong shape per shape family (format, heads, q_len, page size)."""

    ok: set[str]
    wrong: set[str]
    wrong_family: dict[tuple[KVFormat, int, int, int], Shape]


def _shape_family(s: Shape) -> tuple[KVFormat, int, int, int]:
    return (s.kv_format, s.heads, s.q_len, s.page_size)


@dataclass(frozen=True)
class _Family:
    backend: Backend
    sources: frozenset[str]
    """The installed sources' hashes: code hash, and the bytes hash winners files written
    before it carry (the same files)."""
    space: ParamSpace



def _default_device(device: str | torch.device | None) -> torch.device:
    """The dispatcher's device with an explicit index, so it compares equal to tensors'."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _parse_force(spec: str) -> tuple[str, dict[str, str]] | None:
    """`backend:key=value,...` -> (backend, raw values); values are typed per shape
    against the backend's space."""
    spec = spec.strip()
    if not spec:
        return None
    name, _, rest = spec.partition(":")
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{FORCE_ENV}: expected key=value, got {part!r} in {spec!r}")
        pairs[key.strip()] = value.strip()
    return name.strip(), pairs


def _typed_force(space: ParamSpace, raw: Mapping[str, str]) -> dict[str, Any]:
    """Match each forced text value against the declared choices' text."""
    out: dict[str, Any] = {}
    for key, text in raw.items():
        if key not in space.names:
            raise ValueError(f"{FORCE_ENV}: unknown parameter {key!r}; space has {space.names}")
        for choice in space.choices(key):
            if str(choice).lower() == text.lower():
                out[key] = choice
                break
        else:
            raise ValueError(f"{FORCE_ENV}: {key}={text} is not one of "
                             f"{list(space.choices(key))}")
    return out


def _config_shape(config: Any, kv_lens: Sequence[int] | None,
                  kv_format: KVFormat, data: Any = None) -> Shape:
    """The Shape of a call, from its config (and host kv lengths when ragged), checked
    against the call's tensor sizes first when `data` is given."""
    vals = _config_values(config)
    if data is not None:
        _sizes_match(data, vals)
    batch, kv_max = vals["batch_size"], vals["kv_seq_len"]
    try:
        if kv_lens is None:
            return Shape.uniform(batch, kv_max, q_len=vals["q_seq_len"],
                                 heads=vals["num_heads"], kv_format=kv_format)
        lens = tuple(kv_lens)
        if any(type(k) is not int for k in lens):
            raise ValueError(f"kv_lens must be ints, got {lens[:8]!r}...")
        if len(lens) != batch:
            raise ValueError(f"kv_lens has {len(lens)} lengths for batch_size {batch}")
        if lens and max(lens) > kv_max:
            raise ValueError(f"kv_lens max {max(lens)} exceeds config kv_seq_len {kv_max}")
        return Shape(batch, lens, q_len=vals["q_seq_len"], heads=vals["num_heads"],
                     kv_format=kv_format)
    except ShapeError as e:
        raise ValueError(f"config/kv_lens: {e}") from None


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


class Dispatcher:
    """Routes each MLA decode call to its tuned variant (module docstring: the policy)."""

    def __init__(self, winners: Iterable[Winner] = (),
                 device: str | torch.device | None = None, *,
                 kv_format: KVFormat | str | None = None, strict: bool = False,
                 check_inputs: bool = True, origin: str = "an in-memory table") -> None:
        self.device = _default_device(device)
        self.check_inputs = check_inputs
        self.fingerprint = current_device(self.device)
        self.kv_format = KVFormat.parse(kv_format) if kv_format is not None else None
        self.strict = strict
        self.origin = origin
        self.ignored: dict[str, int] = {}
        self._families: dict[str, _Family | str] = {}
        self._table = self._load(list(winners))
        self._uniform: dict[tuple[KVFormat, int, int, int], list[_Loaded]] = {}
        for w in self._table.values():
            s = w.winner.shape
            if not s.is_ragged:
                self._uniform.setdefault((s.kv_format, s.heads, s.q_len, s.page_size),
                                         []).append(w)
        # The forced variant, checked and typed once: (family name, knob values).
        self._force_spec = os.environ.get(FORCE_ENV, "")
        self._force: tuple[str, dict[str, Any]] | None = None
        parsed = _parse_force(self._force_spec)
        if parsed is not None:
            fam = self._family(parsed[0])
            if isinstance(fam, str):
                raise ValueError(f"{FORCE_ENV}: {fam}")
            self._force = (parsed[0], _typed_force(fam.space, parsed[1]))
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

    def _family(self, name: str) -> _Family | str:
        """The backend `name` if it can run here, else why not (cached)."""
        if name not in self._families:
            try:
                b = get_backend(name)
                avail = b.available(self.device)
                self._families[name] = (
                    _Family(b, frozenset({b.source_hash(), b.source_bytes_hash()}),
                            b.declared_space(self.device)) if avail
                    else f"backend {name!r} is not available here: {avail.reason}")
            except Exception as e:  # noqa: BLE001 - an unusable backend is data, not a crash
                self._families[name] = f"backend {name!r} cannot be loaded: {e}"
        return self._families[name]

    def _ignore(self, why: str) -> None:
        self.ignored[why] = self.ignored.get(why, 0) + 1

    def _load(self, records: list[Winner]) -> dict[str, _Loaded]:
        here = self.fingerprint.hash
        usable: list[tuple[Winner, _Family]] = []
        for r in records:
            if r.device.hash != here:
                self._ignore("tuned on another device")
                continue
            fam = self._family(r.backend)
            if isinstance(fam, str):
                log.warning("mla-tune: skipping winner for %s: %s", r.shape.key, fam)
                self._ignore("backend unknown or unavailable")
            elif r.source_hash not in fam.sources:
                self._ignore("kernel sources changed since tuning")
            else:
                usable.append((r, fam))
        extra: dict[str, str] = {}
        own: dict[str, set[str]] = {}
        for fam in {id(f): f for _, f in usable}.values():
            try:
                versions = fam.backend.versions()
            except Exception as e:  # noqa: BLE001
                log.warning("mla-tune: cannot read %s versions: %s", fam.backend.name, e)
                versions = {}
            extra.update(versions)
            own[fam.backend.name] = set(versions)
        self._checks = self._index_checks(usable)
        here_sw = current_software(extra)
        table: dict[str, _Loaded] = {}
        warned: set[str] = set()
        for r, fam in usable:
            try:
                config = fam.space.validate(r.config)
            except ConfigError as e:
                log.warning("mla-tune: skipping winner for %s: config outside the %s space "
                            "(%s)", r.shape.key, r.backend, e)
                self._ignore("config outside its backend's space")
                continue
            # A winner depends on the core stack and on its own backend's libraries only
            # (a FlashInfer upgrade says nothing about a Triton winner).
            relevant = set(CORE_PACKAGES) | own.get(r.backend, set())
            changed = {k: v for k, v in software_diff(r.software, here_sw).items()
                       if k in relevant and v[0] is not None}
            diff = tuple(changed)
            if diff:
                if self.strict:
                    self._ignore("tuned under other library versions (strict)")
                    continue
                if r.software.hash not in warned:
                    warned.add(r.software.hash)
                    log.warning("mla-tune: using winners tuned under other versions (%s); "
                                "pass strict=True to ignore them",
                                ", ".join(f"{k} {a} here {b or 'absent'}"
                                          for k, (a, b) in changed.items()))
            w = _Loaded(r, config, diff)
            prev = table.get(r.shape.key)
            if prev is None or self._rank(w) < self._rank(prev):
                table[r.shape.key] = w
        return table

    @staticmethod
    def _index_checks(usable: list[tuple[Winner, _Family]]
                      ) -> dict[tuple[str, str], _Checks]:
        """(backend, config key) -> where it was verified, from every usable record (a
        winner is verified at its own shape), built once at load."""
        out: dict[tuple[str, str], _Checks] = {}
        for r, fam in usable:
            try:
                key = (r.backend, config_key(fam.space.validate(r.config)))
            except ConfigError:
                continue
            c = out.setdefault(key, _Checks(set(), set(), {}))
            c.ok.update(s.key for s in r.verified_ok)
            c.ok.add(r.shape.key)
            for s in r.verified_wrong:
                c.wrong.add(s.key)
                c.wrong_family.setdefault(_shape_family(s), s)
        return out

    def trust(self, backend: str, config: Mapping[str, Any], shape: Shape
              ) -> tuple[int, str] | None:
        """None if `config` of `backend` was stored wrong at `shape` (never run it there),
        else (tier, why): 0 verified at this shape, 1 never verified here, 2 suspect (wrong
        at another shape of its family)."""
        c = self._checks.get((backend, config_key(config)))
        if c is None:
            return 1, "never verified at this shape"
        return trust_tier(shape.key, _shape_family(shape), c.ok, c.wrong, c.wrong_family)

    @staticmethod
    def _rank(w: _Loaded) -> tuple[Any, ...]:
        return (len(w.stack_diff), w.winner.median_us, w.winner.backend, config_key(w.config))

    @property
    def loaded(self) -> int:
        """Number of shapes with a usable tuned winner."""
        return len(self._table)

    def summary(self) -> str:
        """One line on where the table came from and what was left out, and why."""
        fp = self.fingerprint
        text = (f"{self.loaded} tuned shape(s) from {self.origin} for {fp.name} "
                f"({fp.arch}, fingerprint {fp.hash})")
        if self.ignored:
            text += "; ignored: " + ", ".join(f"{n} {why}" for why, n in
                                              sorted(self.ignored.items()))
        return text

    # -- routing ----------------------------------------------------------------------

    def _forced(self, shape: Shape) -> Decision | None:
        if self._force is None:
            return None
        name, want = self._force
        fam = self._family(name)
        assert not isinstance(fam, str)  # checked in __init__
        if fam.backend.supports(shape) is None:
            for c in fam.backend.candidates(shape, self.device):
                if all(c[k] == v for k, v in want.items()):
                    return Decision(shape, name, c, "forced", f"by {FORCE_ENV}")
        log.warning("mla-tune: %s=%s is not feasible for %s; routing as usual", FORCE_ENV,
                    self._force_spec, shape.key)
        return None

    def _tuned(self, shape: Shape) -> Decision | None:
        """The exact winner, else the first variant moved from or copied off a nearby
        tuned shape (module docstring, steps 1-3)."""
        found = self._tuned_all(shape)
        return found[0] if found else None

    def _tuned_all(self, shape: Shape) -> list[Decision]:
        """The exact winner; else, in the order tried: a variant of the call's family
        verified at this very shape (as tuned), the nearest tuned shape's variant moved by
        the row model ("nearest" when that shape is of the call's family, else
        "transfer"), then the nearest tuned shape of the call's family's variant as tuned
        (the only step for families the row model does not describe)."""
        w = self._table.get(shape.key)
        if w is not None:
            note = f" (tuned under other {'/'.join(w.stack_diff)})" if w.stack_diff else ""
            return [Decision(shape, w.winner.backend, w.config, "exact",
                             f"tuned winner of this shape, {w.winner.median_us:.1f} us{note}",
                             w.winner.median_us, w.winner.shape)]
        as_tuned = self._nearest_as_tuned(shape)
        out = [d for tier, d in as_tuned if tier == 0]
        out += self._moved(shape)
        out += [d for tier, d in as_tuned if tier > 0][:1]
        return out

    def _nearest_as_tuned(self, shape: Shape) -> list[tuple[int, Decision]]:
        """(trust tier, decision) of the nearest feasible tuned uniform shapes of the call's
        family, their variants as tuned: the first verified at this shape, if any, and the
        first by distance over (log batch, log kv length). Never a variant stored wrong
        here, nor one wrong elsewhere in the family (suspect: the heuristic comes first)."""
        def distance(w: _Loaded) -> tuple[float, int, int]:
            s = w.winner.shape
            return nearest_distance(shape.batch, shape.kv_len, s.batch, s.kv_len)

        ranked = []
        for w in self._uniform.get(_shape_family(shape), ()):
            t = self.trust(w.winner.backend, w.config, shape)
            if t is not None and t[0] < 2:
                ranked.append((t[0], distance(w), t[1], w))
        out: list[tuple[int, Decision]] = []
        for tier, dist, why, w in sorted(ranked, key=lambda x: x[:2]):
            fam = self._family(w.winner.backend)
            if isinstance(fam, str) or fam.backend.supports(shape) is not None \
                    or not fam.backend.feasible(shape, w.config) \
                    or any(t == tier for t, _ in out):
                continue
            s = w.winner.shape
            kind = "ragged call: variant of" if shape.is_ragged else "no winner here; variant of"
            out.append((tier, Decision(
                shape, w.winner.backend, w.config, "nearest",
                f"{kind} nearest tuned shape {s.label()} as tuned (log distance "
                f"{dist[0]:.2f}, {w.winner.median_us:.1f} us there; {why})",
                w.winner.median_us, s)))
        return out

    def _moved(self, shape: Shape) -> list[Decision]:
        """The nearest tuned uniform shape of any q_len/heads family (same format and page
        size) by `transfer_distance` (the call's own family first on ties), its variant
        moved by the row model: block and splits re-derived, other knobs kept where the
        call's feasible candidates allow; a few alternatives, in case the first fails its
        precheck. Only row-blocked variants (a `block_m` knob) move: of other families
        nothing says how a config tuned for other rows behaves."""
        rows = shape.q_len * shape.heads
        own = _shape_family(shape)
        sources = []
        for fam_key, winners in self._uniform.items():
            if (fam_key[0], fam_key[3]) != (shape.kv_format, shape.page_size):
                continue
            for w in winners:
                if ROW_BLOCK_KNOB not in w.config:
                    continue  # the model moves row-blocked variants only
                s = w.winner.shape
                sources.append((transfer_distance(shape.batch, shape.kv_len, rows,
                                                  shape.q_len, s.batch, s.kv_len,
                                                  s.q_len * s.heads, s.q_len),
                                fam_key != own, w))
        for dist, other, w in sorted(sources, key=lambda x: (x[0][0], x[1], x[0][1:],
                                                             x[2].winner.backend,
                                                             config_key(x[2].config))):
            fam = self._family(w.winner.backend)
            if isinstance(fam, str) or fam.backend.supports(shape) is not None:
                continue
            moved = self._row_model(w.winner.backend, fam, shape, w, TRANSFER_TRIES)
            if not moved:
                continue
            s = w.winner.shape
            what = ("a tuned shape of another q_len/heads family" if other
                    else "ragged call: nearest tuned shape" if shape.is_ragged
                    else "no winner here; nearest tuned shape")
            head = (f"{what} {s.label()} (distance {dist[0]:.2f} over log batch, kv, "
                    f"rows; {w.winner.median_us:.1f} us there)")
            return [Decision(shape, w.winner.backend, config,
                             "transfer" if other else "nearest",
                             f"{head}; {note}; {trust[1]}", w.winner.median_us, s)
                    for config, trust, note in moved]
        return []

    def _row_model(self, name: str, fam: _Family, shape: Shape, source: _Loaded | None,
                   limit: int) -> list[tuple[dict[str, Any], tuple[int, str], str]]:
        """Up to `limit` feasible configs of family `name` for `shape`, best first, by the
        row model (`routing_rules.model_knobs`): moved from `source`'s tuned variant, or
        the heuristic's when None; none stored wrong here. Each with its trust and a note
        on what the model wanted."""
        cands = fam.backend.candidates(shape, self.device)
        trusted = [(c, t) for c in cands if (t := self.trust(name, c, shape)) is not None]
        if not trusted:
            return []
        rows = shape.q_len * shape.heads
        blocks = {int(c[ROW_BLOCK_KNOB]) for c, _ in trusted if ROW_BLOCK_KNOB in c}
        src = None
        if source is not None:
            s = source.winner.shape
            src = (source.config, s.batch, s.q_len * s.heads, s.kv_len)
        most = max((int(c.get("num_splits", 1)) for c, _ in trusted), default=1)
        block_m, want = model_knobs(shape.batch, rows, shape.kv_len, self.fingerprint.sm_count,
                                    blocks or {16}, src, max_splits=max(most, 1))
        order = model_ranking([c for c, _ in trusted], block_m if blocks else None, want,
                              source.config if source is not None else None,
                              dict(fam.space.params), [t[0] == 2 for _, t in trusted])
        unit = "cores" if self.fingerprint.vendor == "cpu" else "SMs"
        note = (f"row model: {rows} rows" + (f" in blocks of {block_m}" if blocks else "")
                + f", {want:.3g} split(s) over {self.fingerprint.sm_count} {unit}")
        picked = distinct_variants([c for c, _ in trusted], order, limit)
        return [(trusted[i][0], trusted[i][1], note) for i in picked]

    def _heuristic(self, shape: Shape) -> Decision | None:
        """The row model without a tuned shape on the first available family of
        `HEURISTIC_BACKENDS`: the block the rows fill, the occupancy model's splits."""
        for name in HEURISTIC_BACKENDS:
            fam = self._family(name)
            if isinstance(fam, str) or fam.backend.supports(shape) is not None:
                continue
            for config, trust, note in self._row_model(name, fam, shape, None, 1):
                return Decision(shape, name, config, "heuristic",
                                f"no tuned shape to move here; {note}; {trust[1]}")
        return None

    def _last_resort(self, shape: Shape) -> Decision | None:
        fam = self._family(LAST_RESORT)
        if isinstance(fam, str):
            raise RuntimeError(f"mla-tune: no kernel can run here: {fam}")
        cands = fam.backend.candidates(shape, self.device) or [next(fam.space.grid())]
        trust = {i: t for i, c in enumerate(cands)
                 if (t := self.trust(LAST_RESORT, c, shape)) is not None}
        if not trust:
            return None
        best = min(trust, key=lambda i: (trust[i][0] == 2, i))
        return Decision(shape, LAST_RESORT, cands[best], "fallback",
                        "last resort: torch family, first feasible config of its space not "
                        f"stored wrong here; {trust[best][1]}")

    def decisions(self, shape: Shape) -> list[Decision]:
        """Every variant a call of `shape` may run, in the order they are tried."""
        out: list[Decision] = []
        seen: set[tuple[str, str]] = set()
        for d in (self._forced(shape), *self._tuned_all(shape), self._heuristic(shape),
                  self._last_resort(shape)):
            if d is None or (d.backend, config_key(d.config)) in seen:
                continue
            seen.add((d.backend, config_key(d.config)))
            if self.trust(d.backend, d.config, shape) is None:
                log.warning("mla-tune: not running %s %s for %s: stored wrong for this "
                            "shape", d.backend, config_key(d.config), shape.key)
                continue
            out.append(d)
        return out

    def decide(self, shape: Shape) -> Decision:
        """What a call of `shape` runs (if it builds), and why."""
        out = self.decisions(shape)
        if not out:
            raise RuntimeError(f"mla-tune: every variant that could run {shape.key} was "
                               "stored wrong for it")
        return out[0]

    def choose_format(self, shape: Shape, present: Iterable[str]) -> KVFormat:
        """The KV format a call of `shape` (its own format ignored) runs in, among the
        `present` ones (module docstring: the policy)."""
        have = [f for f in FORMAT_ORDER if f.value in set(present)]
        if self.kv_format is not None:
            if self.kv_format not in have:
                raise ValueError(f"kv_data lacks {self.kv_format.value!r}, the pinned format")
            return self.kv_format
        if not have:
            raise ValueError(f"kv_data holds none of {[f.value for f in FORMAT_ORDER]}")

        def estimate(f: KVFormat) -> tuple[int, float, int]:
            s = shape.with_format(f)
            d = self._tuned(s)
            if d is None or d.tuned_shape is None:
                return format_rank(None, None, s.total_kv, None, f.value)
            return format_rank(d.reason, d.tuned_us, s.total_kv, d.tuned_shape.total_kv,
                               f.value)

        return min(have, key=estimate)

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
