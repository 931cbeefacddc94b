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
2. else the winner of the nearest tuned shape with the same KV format, heads and q_len,
   by distance over (log batch, log kv length), ties to the smaller shape; variants
   verified at this very shape first, and none stored wrong anywhere in that family
   (suspect); the decision says when the variant was never verified at this shape;
3. else the occupancy heuristic (`occupancy_splits`) on the first available family of
   `HEURISTIC_BACKENDS`;
4. else the torch family with the first feasible config of its space.
A variant that fails its backend's precheck, its build or its first call falls through to
the next step. No step ever runs a variant stored wrong for the call's exact shape.
Fallbacks are logged once per key (nearest: INFO; heuristic and torch: WARNING);
`MLA_TUNE_TRACE=1` prints every routing decision once per key to stderr. Routing depends
only on the loaded table, the call's shape and the device model, never on timing or GPU
index, so every rank of a job runs the same variants (a variant that fails on one rank is
the only exception).

KV format. The task's `kv_data` holds several formats; unless `kv_format=` pins one, each
shape runs in the format, among those present in the call, with the fastest tuned winner
for the exact shape. Without an exact winner in any present format, the nearest tuned
shapes' medians are compared, scaled by the ratio of KV tokens (decode is memory-bound);
formats without tuned data come last, in the order bf16, fp8, mxfp4.

Ragged batches. The config gives only the longest kv length and the lengths live on the
device. A task tuple whose KV holds fewer than `batch * kv_seq_len` rows (and at least the
longest sequence plus `q_seq_len` per other one) is a ragged call and runs its length
bucket's runner (mla_tune/buckets.py): routed from the batch and the mean length (KV rows
/ batch) only, built once per bucket, reading the lengths from `kv_indptr` on the device,
so a growing serving loop builds nothing after each bucket's first call and a call is
capturable in a CUDA graph. `run(data, kv_lens=[...])` checks the host lengths against the
call and takes the same bucket; only where winners tuned on ragged batches were loaded does
it look for the exact ragged winner first (built per lengths tuple, the last
`RAGGED_CACHE`). Paged KV pools: `MLADecodeWrapper` (mla_tune/serving.py).

Hot path. Per call: the key lookup, dtype/shape/device/contiguity checks and the config's
fixed fields and `sm_scale` (a wrong input raises ValueError naming the argument, before
any launch, exactly as on a first call) and the kernel. The tensor checks are
most of the dispatcher's cost (14 tensor-metadata reads: the dispatcher adds 3.75 us per
call with them and 0.60 us without on the H200 host, bench/results/h200_session_2026-11-30.md);
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
import math
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mla_tune.backends import Backend, get_backend
from mla_tune.fingerprint import CORE_PACKAGES, current_device, current_software, software_diff
from mla_tune.problem import (
    KV_LORA_RANK,
    QK_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    SM_SCALE,
    V_HEAD_DIM,
    KVFormat,
    Shape,
    ShapeError,
    TaskInput,
)
from mla_tune.routing_rules import (
    CALL_KEY_FIELDS,
    closest_splits,
    format_rank,
    nearest_distance,
    occupancy_splits,
    trust_tier,
)
from mla_tune.space import ConfigError, ParamSpace, config_key
from mla_tune.winners_json import WinnerRecord, load_winners_json

log = logging.getLogger(__name__)

FORCE_ENV = "MLA_TUNE_FORCE"
TRACE_ENV = "MLA_TUNE_TRACE"
HEURISTIC_BACKENDS = ("triton", "torch")
LAST_RESORT = "torch"
FORMAT_ORDER = (KVFormat.BF16, KVFormat.FP8, KVFormat.MXFP4)
RAGGED_CACHE = 64
FP4_PACKED_DIM = QK_HEAD_DIM // 2
MXFP4_BLOCKS = QK_HEAD_DIM // 32

_FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e4m3fnuz})
_FP4_DTYPES = frozenset({torch.uint8} | ({torch.float4_e2m1fn_x2}
                                        if hasattr(torch, "float4_e2m1fn_x2") else set()))
_E8M0_DTYPES = frozenset({torch.uint8} | ({torch.float8_e8m0fnu}
                                         if hasattr(torch, "float8_e8m0fnu") else set()))
_KEY_FIELDS = CALL_KEY_FIELDS
_FIXED_FIELDS = {"num_kv_heads": 1, "qk_head_dim": QK_HEAD_DIM, "kv_lora_rank": KV_LORA_RANK,
                 "qk_rope_head_dim": QK_ROPE_HEAD_DIM, "v_head_dim": V_HEAD_DIM}

Runner = Callable[[TaskInput], torch.Tensor]


@dataclass(frozen=True)
class Decision:
    """One routing choice and why: what `mla-tune route` prints and the trace logs."""

    shape: Shape
    backend: str
    config: dict[str, Any]
    reason: str  # forced | exact | nearest | heuristic | fallback
    detail: str
    tuned_us: float | None = None
    tuned_shape: Shape | None = None

    def describe(self) -> str:
        return (f"{self.shape.key} -> {self.backend} {config_key(self.config)} "
                f"[{self.reason}] {self.detail}")


@dataclass(frozen=True)
class _Winner:
    record: WinnerRecord
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


def _config_values(config: Any) -> dict[str, int]:
    """The key fields of a call's config, after checking every field the task's config
    has (a missing or other-valued one is a ValueError naming it): the kernels assume
    them, and the Triton family's scale is built in."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    vals = {}
    for f in _KEY_FIELDS:
        v = config.get(f)
        if type(v) is not int or v < 1:
            raise ValueError(f"config[{f!r}] must be a positive int, got {v!r:.80}")
        vals[f] = v
    for f, want in _FIXED_FIELDS.items():
        if f not in config:
            raise ValueError(f"config lacks {f!r} (the task's config has {f}={want})")
        if config[f] != want:
            raise ValueError(f"config[{f!r}] is {config[f]!r:.80}; MLA decode here needs "
                             f"{want}")
    scale = config.get("sm_scale")
    if scale is None:
        raise ValueError(f"config lacks 'sm_scale' (the task's is 1/sqrt({QK_HEAD_DIM}) = "
                         f"{SM_SCALE})")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isclose(scale, SM_SCALE, rel_tol=1e-6):
        raise ValueError(f"config['sm_scale'] is {scale!r:.80}; the tuned kernels use "
                         f"1/sqrt({QK_HEAD_DIM}) = {SM_SCALE}")
    return vals


def _sizes_match(data: Any, vals: Mapping[str, int]) -> None:
    """Compare the config with the tensors' sizes before anything is built from it, so a
    config claiming a batch of 10**8 fails at once instead of after gigabytes."""
    batch, rows = vals["batch_size"], vals["batch_size"] * vals["q_seq_len"]
    q, _, qo, kvp, _ = data
    if isinstance(q, torch.Tensor) and q.dim() == 3 \
            and (q.shape[0] != rows or q.shape[1] != vals["num_heads"]):
        raise ValueError(f"q has shape {tuple(q.shape)}; config batch_size {batch}, "
                         f"q_seq_len {vals['q_seq_len']} and num_heads {vals['num_heads']} "
                         f"need ({rows}, {vals['num_heads']}, {QK_HEAD_DIM})")
    for t, n in ((qo, "qo_indptr"), (kvp, "kv_indptr")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.numel() != batch + 1:
            raise ValueError(f"{n} has {t.numel()} elements; expected {batch + 1} (config "
                             f"batch_size {batch})")


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


def _check_tensor(t: Any, name: str, dtypes: Iterable[torch.dtype],
                  shape: tuple[int, ...] | int, device: torch.device,
                  contiguous: bool = False) -> None:
    """Raise ValueError naming `name` unless `t` matches. `shape` is exact, except that a
    negative entry -n means at least n; an int means that many elements, any shape."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = sorted(str(d) for d in dtypes)
    if str(t.dtype) not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {' or '.join(allowed)}")
    if isinstance(shape, int):
        if t.numel() != shape:
            raise ValueError(f"{name} has {t.numel()} elements; expected {shape}")
    elif t.dim() != len(shape) or any(t.shape[i] < -w if w < 0 else t.shape[i] != w
                                      for i, w in enumerate(shape)):
        want = tuple(f">={-w}" if w < 0 else w for w in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; the dispatcher runs on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def validate_inputs(data: Any, shape: Shape, device: torch.device) -> None:
    """Validate a call against `shape` and `device`, raising ValueError that names the
    offending argument; the slow, explicit twin of the runners' fast checks."""
    if not isinstance(data, (tuple, list)) or len(data) != 5:
        raise ValueError("data must be the tuple (q, kv_data, qo_indptr, kv_indptr, config)")
    q, kv_data, qo, kvp, _ = data
    _check_tensor(q, "q", [torch.bfloat16], (shape.total_q, shape.heads, QK_HEAD_DIM),
                  device, contiguous=True)
    fmt = shape.kv_format.value
    if not isinstance(kv_data, Mapping):
        raise ValueError(f"kv_data must be a dict of KV formats, got {type(kv_data).__name__}")
    if fmt not in kv_data:
        raise ValueError(f"kv_data lacks {fmt!r}, the format this call runs in")
    entry, name, rows = kv_data[fmt], f"kv_data[{fmt!r}]", shape.total_kv
    if shape.kv_format is KVFormat.BF16:
        _check_tensor(entry, name, [torch.bfloat16], (rows, 1, QK_HEAD_DIM), device, True)
    else:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"{name} must be a (values, scale) pair")
        if shape.kv_format is KVFormat.FP8:
            _check_tensor(entry[0], f"{name}[0]", _FP8_DTYPES, (rows, 1, QK_HEAD_DIM), device,
                          True)
            _check_tensor(entry[1], f"{name}[1]", [torch.float32], 1, device)
        else:
            _check_tensor(entry[0], f"{name}[0]", _FP4_DTYPES, (rows, 1, FP4_PACKED_DIM),
                          device, True)
            _check_tensor(entry[1], f"{name}[1]", _E8M0_DTYPES, (-rows, -MXFP4_BLOCKS),
                          device)
    for t, n in ((qo, "qo_indptr"), (kvp, "kv_indptr")):
        _check_tensor(t, n, [torch.int32], shape.batch + 1, device)


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

    def __init__(self, winners: Iterable[WinnerRecord] = (),
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
        self._uniform: dict[tuple[KVFormat, int, int, int], list[_Winner]] = {}
        for w in self._table.values():
            s = w.record.shape
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
    def from_db(cls, url_or_path: str | None = None, device: str | torch.device | None = None,
                *, kv_format: KVFormat | str | None = None, strict: bool = False,
                check_inputs: bool = True) -> "Dispatcher":
        """Load the tuning DB's winners once (this device's are kept: module docstring).
        Without `url_or_path` and $MLA_TUNE_DB, the user's ./tuning.db (when it exists) and
        the winners shipped with mla-tune are layered: records of both, ranked as usual.
        A DB is opened read-only (`TuningStore(read_only=True)`): never created, migrated
        or locked. A missing, unreadable, corrupt or other-schema DB (or no SQLAlchemy
        installed) is a warning, never an error; so is a winner row that does not decode
        (that row is skipped, not the table)."""
        dev = _default_device(device)
        here = current_device(dev).hash
        sources: list[str | None] = [url_or_path]
        if not url_or_path:
            try:
                from mla_tune.db import default_db_path, shipped_db_url

                local = default_db_path()
                if local is not None:  # no DB named anywhere: local (if any) + shipped
                    sources = [None] if local.exists() else []
                    sources.append(shipped_db_url())
            except Exception as e:  # noqa: BLE001 - serving must never fail on the tuning DB
                log.warning("mla-tune: the shipped tuning results cannot be located (%s)", e)
        records: list[WinnerRecord] = []
        origins: list[str] = []
        for source in sources:
            origin = "no tuning DB"
            try:
                from mla_tune.db import TuningStore, resolve_url
                from mla_tune.winners_json import records_from_store

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
        records: list[WinnerRecord] = []
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

    def _load(self, records: list[WinnerRecord]) -> dict[str, _Winner]:
        here = self.fingerprint.hash
        usable: list[tuple[WinnerRecord, _Family]] = []
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
        table: dict[str, _Winner] = {}
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
            w = _Winner(r, config, diff)
            prev = table.get(r.shape.key)
            if prev is None or self._rank(w) < self._rank(prev):
                table[r.shape.key] = w
        return table

    @staticmethod
    def _index_checks(usable: list[tuple[WinnerRecord, _Family]]
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
    def _rank(w: _Winner) -> tuple[Any, ...]:
        return (len(w.stack_diff), w.record.median_us, w.record.backend, config_key(w.config))

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
        """The exact winner, else the nearest feasible tuned uniform shape's variant."""
        w = self._table.get(shape.key)
        if w is not None:
            note = f" (tuned under other {'/'.join(w.stack_diff)})" if w.stack_diff else ""
            return Decision(shape, w.record.backend, w.config, "exact",
                            f"tuned winner of this shape, {w.record.median_us:.1f} us{note}",
                            w.record.median_us, w.record.shape)

        def distance(w: _Winner) -> tuple[float, int, int]:
            s = w.record.shape
            return nearest_distance(shape.batch, shape.kv_len, s.batch, s.kv_len)

        # Never a variant stored wrong here, nor one wrong elsewhere in the family (suspect:
        # the heuristic comes first); verified here beats never verified, then distance.
        ranked = []
        for w in self._uniform.get(_shape_family(shape), ()):
            t = self.trust(w.record.backend, w.config, shape)
            if t is not None and t[0] < 2:
                ranked.append((t[0], distance(w), t[1], w))
        for tier, dist, why, w in sorted(ranked, key=lambda x: x[:2]):
            fam = self._family(w.record.backend)
            if isinstance(fam, str) or fam.backend.supports(shape) is not None \
                    or not fam.backend.feasible(shape, w.config):
                continue
            s = w.record.shape
            kind = "ragged call: variant of" if shape.is_ragged else "no winner here; variant of"
            return Decision(shape, w.record.backend, w.config, "nearest",
                            f"{kind} nearest tuned shape {s.label()} (log distance "
                            f"{dist[0]:.2f}, {w.record.median_us:.1f} us there; {why})",
                            w.record.median_us, s)
        return None

    def _heuristic(self, shape: Shape) -> Decision | None:
        units = self.fingerprint.sm_count
        splits = occupancy_splits(shape.batch, shape.q_len * shape.heads, shape.kv_len, units)
        for name in HEURISTIC_BACKENDS:
            fam = self._family(name)
            if isinstance(fam, str) or fam.backend.supports(shape) is not None:
                continue
            cands = fam.backend.candidates(shape, self.device)
            trust = {i: t for i, c in enumerate(cands)
                     if (t := self.trust(name, c, shape)) is not None}
            if not trust:
                continue

            # Without a num_splits knob every gap ties: the first unsuspected candidate.
            idx = sorted(trust)
            best = idx[closest_splits([cands[i].get("num_splits", 1) for i in idx], splits,
                                      [trust[i][0] == 2 for i in idx])]
            unit = "cores" if self.fingerprint.vendor == "cpu" else "SMs"
            return Decision(shape, name, cands[best], "heuristic",
                            f"no tuned shape of this format/heads/q_len; occupancy model "
                            f"wants {splits} split(s) over {units} {unit}; {trust[best][1]}")
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
        for d in (self._forced(shape), self._tuned(shape), self._heuristic(shape),
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
        from mla_tune.buckets import router_for

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
        from mla_tune.buckets import ragged_rows, router_for

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
            from mla_tune.buckets import ragged_rows, router_for

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
        elif d.reason in ("heuristic", "fallback"):
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
