"""The one record of a tuned winner, shared by the store, the winners file, the dispatcher
and the reports: what was tuned (device, software stack, shape), what won (backend, its
kernel sources, config) and how fast, with where that config was verified.

The store adds what only a DB knows (row ids, the trial, when it was stored, the device's
measured read bandwidth); those facts say where a winner is kept, not what it is, so they
take no part in equality: a winner exported to a file and imported elsewhere is the same
winner. Views (the dispatcher's loaded table, report and diff rows) hold a `Winner` and add
their own fields; none redefines it.

Every field of a winner from outside (a file, a DB row) goes through `Winner.from_json`,
which checks type and range and caps every size, so a file and a DB are held to one
standard.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mla_tune.machine.fingerprint import VENDORS, DeviceFingerprint, SoftwareFingerprint
from mla_tune.problem.shapes import KVFormat, Shape, ShapeError

MAX_CONFIG_PARAMS = 64
MAX_TEXT = 256
MAX_BATCH = 1 << 20
MAX_VERIFIED = 4096
MAX_CONFIG_INT = 1 << 62

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HASH_RE = re.compile(r"[0-9a-f]{1,64}")
_ENTRY_KEYS = {"device", "software", "shape", "shape_key", "backend", "source_hash", "config",
               "median_us"}
_VERIFIED_KEYS = {"verified_ok", "verified_wrong"}
_DEVICE_KEYS = {"vendor", "name", "arch", "sm_count", "memory_bytes"}
_SHAPE_KEYS = {"batch", "kv_lens", "q_len", "heads", "kv_format", "page_size"}


class WinnerDataError(ValueError):
    """Data that no winner can hold; the message names the offending field."""


@dataclass(frozen=True)
class Winner:
    """One tuned winner: the record every reader of winners takes."""

    device: DeviceFingerprint
    software: SoftwareFingerprint
    shape: Shape
    backend: str
    source_hash: str
    config: dict[str, int | float | str | bool]
    median_us: float
    verified_ok: tuple[Shape, ...] = ()
    """Shapes where this config (device, backend, sources) matched the reference."""
    verified_wrong: tuple[Shape, ...] = ()
    """Shapes where it was stored `wrong`: never run there."""
    # What only a DB knows (None for a winner read from a file).
    id: int | None = field(default=None, compare=False)
    device_id: int | None = field(default=None, compare=False)
    software_id: int | None = field(default=None, compare=False)
    trial_id: int | None = field(default=None, compare=False)
    """The trial that won."""
    updated_at: datetime | None = field(default=None, compare=False)
    device_read_bw_gbps: float | None = field(default=None, compare=False)
    """The device's stored read bandwidth, if it was measured."""

    @property
    def shape_key(self) -> str:
        return self.shape.key

    @classmethod
    def from_json(cls, value: Any, where: str = "winner", version: int = 2) -> "Winner":
        """A winner from its JSON entry (`to_json`'s form; `verified_ok` / `verified_wrong`
        from version 2 on), every field checked; raises WinnerDataError naming `where`."""
        return _parse_entry(value, where, version)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device.to_json(), "software": self.software.to_json(),
                "shape": self.shape.to_json(), "shape_key": self.shape.key,
                "backend": self.backend, "source_hash": self.source_hash,
                "config": dict(self.config), "median_us": self.median_us,
                "verified_ok": [s.to_json() for s in self.verified_ok],
                "verified_wrong": [s.to_json() for s in self.verified_wrong]}


def _fail(where: str, message: str) -> WinnerDataError:
    return WinnerDataError(f"{where}: {message}")


def _obj(value: Any, where: str, keys: set[str] | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected an object, got {type(value).__name__}")
    if keys is not None and set(value) != keys:
        extra, missing = sorted(set(value) - keys), sorted(keys - set(value))
        raise _fail(where, f"unexpected keys {extra}" if extra else f"missing keys {missing}")
    return value


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(where, f"expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def _text(value: Any, where: str, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        raise _fail(where, f"expected a non-empty string of at most {MAX_TEXT} characters")
    if pattern is not None and not pattern.fullmatch(value):
        raise _fail(where, f"{value!r} does not match {pattern.pattern}")
    return value


def _device(value: Any, where: str) -> DeviceFingerprint:
    d = _obj(value, where, _DEVICE_KEYS)
    vendor = _text(d["vendor"], f"{where}.vendor")
    if vendor not in VENDORS:
        raise _fail(f"{where}.vendor", f"expected one of {list(VENDORS)}, got {vendor!r}")
    return DeviceFingerprint(vendor=vendor, name=_text(d["name"], f"{where}.name"),
                             arch=_text(d["arch"], f"{where}.arch"),
                             sm_count=_int(d["sm_count"], f"{where}.sm_count", 1, 1 << 20),
                             memory_bytes=_int(d["memory_bytes"], f"{where}.memory_bytes",
                                               0, 1 << 60))


def _software(value: Any, where: str) -> SoftwareFingerprint:
    d = _obj(value, where)
    if not 0 < len(d) <= MAX_CONFIG_PARAMS:
        raise _fail(where, f"expected 1 to {MAX_CONFIG_PARAMS} packages, got {len(d)}")
    for k, v in d.items():
        _text(k, f"{where} key", _NAME_RE)
        _text(v, f"{where}.{k}")
    return SoftwareFingerprint(tuple(d.items()))


def parse_shape(value: Any, where: str) -> Shape:
    """A shape from its JSON object, every size capped (a file or DB row is never trusted);
    raises WinnerDataError naming `where`."""
    d = _obj(value, where, _SHAPE_KEYS)
    batch = _int(d["batch"], f"{where}.batch", 1, MAX_BATCH)
    kv = d["kv_lens"]
    if isinstance(kv, list):
        if len(kv) != batch:
            raise _fail(f"{where}.kv_lens", f"{len(kv)} lengths for batch {batch}")
        kv_lens = tuple(_int(x, f"{where}.kv_lens[{i}]", 1, 1 << 30) for i, x in enumerate(kv))
    else:
        kv_lens = (_int(kv, f"{where}.kv_lens", 1, 1 << 30),) * batch
    fmt = _text(d["kv_format"], f"{where}.kv_format")
    try:
        return Shape(batch, kv_lens, q_len=_int(d["q_len"], f"{where}.q_len", 1, 64),
                     heads=_int(d["heads"], f"{where}.heads", 1, 4096),
                     kv_format=KVFormat.parse(fmt),
                     page_size=_int(d["page_size"], f"{where}.page_size", 1, 1 << 20))
    except (ShapeError, ValueError) as e:
        raise _fail(where, str(e)) from None


def _config(value: Any, where: str) -> dict[str, int | float | str | bool]:
    d = _obj(value, where)
    if len(d) > MAX_CONFIG_PARAMS:
        raise _fail(where, f"more than {MAX_CONFIG_PARAMS} parameters")
    for k, v in d.items():
        _text(k, f"{where} key", _NAME_RE)
        if isinstance(v, str):
            _text(v, f"{where}.{k}")
        elif isinstance(v, float) and not math.isfinite(v):
            raise _fail(f"{where}.{k}", f"not a finite number: {v!r}")
        elif type(v) is int and abs(v) > MAX_CONFIG_INT:
            raise _fail(f"{where}.{k}", "integer out of range (|v| > 2^62)")
        elif not isinstance(v, (bool, int, float)):
            raise _fail(f"{where}.{k}", f"expected a scalar, got {type(v).__name__}")
    return dict(d)


def _shapes(value: Any, where: str) -> tuple[Shape, ...]:
    if not isinstance(value, list) or len(value) > MAX_VERIFIED:
        raise _fail(where, f"expected a list of at most {MAX_VERIFIED} shapes")
    return tuple(parse_shape(v, f"{where}[{i}]") for i, v in enumerate(value))


def _parse_entry(value: Any, where: str, version: int) -> Winner:
    e = _obj(value, where)
    keys, allowed = set(e), _ENTRY_KEYS | (_VERIFIED_KEYS if version >= 2 else set())
    if not _ENTRY_KEYS <= keys <= allowed:
        extra, missing = sorted(keys - allowed), sorted(_ENTRY_KEYS - keys)
        raise _fail(where, f"unexpected keys {extra}" if extra else f"missing keys {missing}")
    shape = parse_shape(e["shape"], f"{where}.shape")
    key = _text(e["shape_key"], f"{where}.shape_key")
    if key != shape.key:
        raise _fail(f"{where}.shape_key", f"{key!r} does not match its shape ({shape.key!r})")
    median = e["median_us"]
    if isinstance(median, bool) or not isinstance(median, (int, float)) \
            or (type(median) is int and median > MAX_CONFIG_INT) \
            or not (math.isfinite(median) and median > 0):
        raise _fail(f"{where}.median_us", f"expected a positive number, got {median!r}"[:200])
    return Winner(device=_device(e["device"], f"{where}.device"),
                  software=_software(e["software"], f"{where}.software"), shape=shape,
                  backend=_text(e["backend"], f"{where}.backend", _NAME_RE),
                  source_hash=_text(e["source_hash"], f"{where}.source_hash", _HASH_RE),
                  config=_config(e["config"], f"{where}.config"),
                  median_us=float(median),
                  verified_ok=_shapes(e.get("verified_ok", []), f"{where}.verified_ok"),
                  verified_wrong=_shapes(e.get("verified_wrong", []),
                                         f"{where}.verified_wrong"))
