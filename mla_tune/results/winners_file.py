"""The winners file: tuned winners as a versioned JSON document, so a wheel, a leaderboard
submission or another machine can carry its routing table without SQLite.

    {"format": "mla-tune-winners", "version": 2, "winners": [
      {"device": {vendor, name, arch, sm_count, memory_bytes},
       "software": {"python": "3.11.7", "torch": "2.13.0", ...},
       "shape": {batch, kv_lens, q_len, heads, kv_format, page_size},
       "shape_key": "b4-q1-kv1024-h16-bf16-p1",
       "backend": "torch", "source_hash": "0123456789abcdef",
       "config": {"num_splits": 4, ...}, "median_us": 41.2,
       "verified_ok": [shape, ...], "verified_wrong": [shape, ...]}, ...]}

`verified_ok` / `verified_wrong` (version 2) are the shapes where the sweep checked this
winner's config (same device, backend and sources) against the reference and it matched /
did not: the dispatcher never runs a config where it was stored wrong. Version-1 files
(without them) still load, with no verification facts.

A winners file is data, never code: it is parsed with `json` alone and every field is
checked for type and range before anything else sees it (unknown keys, duplicate keys,
NaN/Infinity, deep nesting, huge integers, oversized or non-regular files and inconsistent
shape keys are all refused). Whether a config is a point of its backend's space is checked
later, by whoever builds it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mla_tune.machine.fingerprint import VENDORS, DeviceFingerprint, SoftwareFingerprint
from mla_tune.problem.shapes import KVFormat, Shape, ShapeError

if TYPE_CHECKING:
    from mla_tune.db import TuningStore, WinnerRow

FORMAT = "mla-tune-winners"
VERSION = 2
READS_VERSIONS = (1, 2)
MAX_FILE_BYTES = 64 * 2**20
MAX_ENTRIES = 100_000
MAX_CONFIG_PARAMS = 64
MAX_TEXT = 256
MAX_BATCH = 1 << 20
MAX_VERIFIED = 4096
MAX_CONFIG_INT = 1 << 62

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HASH_RE = re.compile(r"[0-9a-f]{1,64}")
_DOC_KEYS = {"format", "version", "winners"}
_ENTRY_KEYS = {"device", "software", "shape", "shape_key", "backend", "source_hash", "config",
               "median_us"}
_VERIFIED_KEYS = {"verified_ok", "verified_wrong"}
_DEVICE_KEYS = {"vendor", "name", "arch", "sm_count", "memory_bytes"}
_SHAPE_KEYS = {"batch", "kv_lens", "q_len", "heads", "kv_format", "page_size"}


class WinnersFileError(ValueError):
    """A winners document that is not exactly what this module writes; the message names
    the offending field."""


@dataclass(frozen=True)
class WinnerRecord:
    """One tuned winner, independent of any database: what the dispatcher loads."""

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

    @classmethod
    def from_row(cls, row: WinnerRow, verified_ok: tuple[Shape, ...] = (),
                 verified_wrong: tuple[Shape, ...] = ()) -> "WinnerRecord":
        """A record from a DB winner row; the shape goes through the same strict parser as a
        file's, so a DB and a file are held to one standard."""
        r = _parse_entry({
            "device": row.device.to_json(), "software": row.software.to_json(),
            "shape": row.shape_json, "shape_key": row.shape_key, "backend": row.backend,
            "source_hash": row.source_hash, "config": row.config,
            "median_us": row.median_us}, "winner")
        return replace(r, verified_ok=verified_ok, verified_wrong=verified_wrong)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device.to_json(), "software": self.software.to_json(),
                "shape": self.shape.to_json(), "shape_key": self.shape.key,
                "backend": self.backend, "source_hash": self.source_hash,
                "config": dict(self.config), "median_us": self.median_us,
                "verified_ok": [s.to_json() for s in self.verified_ok],
                "verified_wrong": [s.to_json() for s in self.verified_wrong]}


def _fail(where: str, message: str) -> WinnersFileError:
    return WinnersFileError(f"{where}: {message}")


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


def _shape(value: Any, where: str) -> Shape:
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
    return tuple(_shape(v, f"{where}[{i}]") for i, v in enumerate(value))


def _parse_entry(value: Any, where: str, version: int = 1) -> WinnerRecord:
    e = _obj(value, where)
    keys, allowed = set(e), _ENTRY_KEYS | (_VERIFIED_KEYS if version >= 2 else set())
    if not _ENTRY_KEYS <= keys <= allowed:
        extra, missing = sorted(keys - allowed), sorted(_ENTRY_KEYS - keys)
        raise _fail(where, f"unexpected keys {extra}" if extra else f"missing keys {missing}")
    shape = _shape(e["shape"], f"{where}.shape")
    key = _text(e["shape_key"], f"{where}.shape_key")
    if key != shape.key:
        raise _fail(f"{where}.shape_key", f"{key!r} does not match its shape ({shape.key!r})")
    median = e["median_us"]
    if isinstance(median, bool) or not isinstance(median, (int, float)) \
            or (type(median) is int and median > MAX_CONFIG_INT) \
            or not (math.isfinite(median) and median > 0):
        raise _fail(f"{where}.median_us", f"expected a positive number, got {median!r}"[:200])
    return WinnerRecord(device=_device(e["device"], f"{where}.device"),
                        software=_software(e["software"], f"{where}.software"), shape=shape,
                        backend=_text(e["backend"], f"{where}.backend", _NAME_RE),
                        source_hash=_text(e["source_hash"], f"{where}.source_hash", _HASH_RE),
                        config=_config(e["config"], f"{where}.config"),
                        median_us=float(median),
                        verified_ok=_shapes(e.get("verified_ok", []), f"{where}.verified_ok"),
                        verified_wrong=_shapes(e.get("verified_wrong", []),
                                               f"{where}.verified_wrong"))


def parse_winners(doc: Any) -> list[WinnerRecord]:
    """Validate a decoded winners document and return its records, in file order."""
    d = _obj(doc, "document", _DOC_KEYS)
    if d["format"] != FORMAT:
        raise _fail("format", f"expected {FORMAT!r}, got {d['format']!r}")
    version = d["version"]
    if type(version) is not int or version not in READS_VERSIONS:
        raise _fail("version", f"this mla-tune reads versions {list(READS_VERSIONS)}, got "
                    f"{version!r}"[:200])
    entries = d["winners"]
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise _fail("winners", f"expected a list of at most {MAX_ENTRIES} entries")
    records, seen = [], set()
    for i, entry in enumerate(entries):
        r = _parse_entry(entry, f"winners[{i}]", version)
        key = (r.device.hash, r.software.hash, r.shape.key)
        if key in seen:
            raise _fail(f"winners[{i}]", f"a second winner for {r.shape.key} on the same "
                        "device and software stack")
        seen.add(key)
        records.append(r)
    return records


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise WinnersFileError(f"duplicate key {k!r} in an object")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise WinnersFileError(f"{name} is not allowed in a winners file")


def _read_bounded(p: Path) -> bytes:
    """The bytes of a regular file of at most MAX_FILE_BYTES. Opened without blocking (a
    FIFO would wait for a writer forever) and read up to the cap whatever `st_size` says
    (0 for /dev/zero and other special files, which are refused anyway)."""
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise WinnersFileError(f"{p} is not a regular file (a winners file is plain JSON)")
        chunks, left = [], MAX_FILE_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        raise WinnersFileError(f"{p} is over the {MAX_FILE_BYTES}-byte limit")
    return b"".join(chunks)


def load_winners_json(path: str | os.PathLike[str]) -> list[WinnerRecord]:
    """Read and strictly validate a winners file. Raises OSError if it cannot be read and
    WinnersFileError if it is not a valid winners document of a version this reads."""
    p = Path(path)
    raw = _read_bounded(p)
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                         parse_constant=_no_constants)
    except WinnersFileError:
        raise
    except RecursionError:
        raise WinnersFileError(f"{p} is nested too deeply to be a winners file") from None
    except ValueError as e:  # bad UTF-8, bad JSON, an integer of thousands of digits
        raise WinnersFileError(f"{p} is not JSON: {str(e)[:200]}") from None
    return parse_winners(doc)


def winners_document(records: list[WinnerRecord]) -> dict[str, Any]:
    """The version-1 document for `records` (what `export_winners` writes)."""
    return {"format": FORMAT, "version": VERSION, "winners": [r.to_json() for r in records]}


def write_winners_json(records: list[WinnerRecord], path: str | os.PathLike[str]) -> None:
    """Write `records` atomically: a reader never sees a half-written file."""
    p = Path(path)
    text = json.dumps(winners_document(records), indent=1, sort_keys=True, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.absolute().parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _verification(store: TuningStore, rows: list[WinnerRow]
                  ) -> dict[tuple[int, str, str, str], tuple[dict[str, Shape], dict[str, Shape]]]:
    """(device id, backend, source hash, config key) -> shapes it was stored ok / wrong at,
    for the groups the winner rows name (one query per group, not per winner)."""
    from mla_tune.tuning.space import config_key

    wanted = {(r.device_id, r.backend, r.source_hash) for r in rows}
    keys = {(r.device_id, r.backend, r.source_hash, config_key(r.config)) for r in rows}
    out: dict[tuple[int, str, str, str], tuple[dict[str, Shape], dict[str, Shape]]] = {}
    for device_id, backend, source in sorted(wanted):
        for status, side in (("ok", 0), ("wrong", 1)):
            for t in store.trials(device_id=device_id, backend=backend, source_hash=source,
                                  status=status):
                key = (device_id, backend, source, t.config_key)
                if key not in keys:
                    continue
                try:
                    shape = _shape(t.shape_json, f"trial {t.id} shape")
                except WinnersFileError as e:
                    log.warning("mla-tune: skipping a malformed trial: %s", e)
                    continue
                out.setdefault(key, ({}, {}))[side].setdefault(shape.key, shape)
    return out


def records_from_store(store: TuningStore, device_hash: str | None = None,
                       warn: Callable[[str], None] | None = None,
                       verified_for: str | None = None) -> list[WinnerRecord]:
    """The store's winners (all devices, or the one with `device_hash`) as records carrying
    where each config was verified ok / wrong (for every device's winners, or only those of
    device `verified_for`: the others' trials are not read). A winner row that does not
    decode is skipped with a warning naming it (`warn`, default: logged), never the table."""
    from mla_tune.tuning.space import config_key

    say = warn or (lambda m: log.warning("%s", m))
    rows = store.winners(device_hash=device_hash)
    try:
        facts = _verification(store, [r for r in rows if verified_for in (None, r.device.hash)])
    except Exception as e:  # noqa: BLE001 - winners stay usable without verification facts
        say(f"mla-tune: cannot read verification facts from {store.url} ({e}); every "
            "nearest-shape fallback counts as unverified")
        facts = {}
    records = []
    for row in rows:
        try:
            ok, wrong = facts.get((row.device_id, row.backend, row.source_hash,
                                   config_key(row.config)), ({}, {}))
            records.append(WinnerRecord.from_row(row, tuple(ok.values()),
                                                 tuple(wrong.values())))
        except Exception as e:  # noqa: BLE001 - one bad row never hides the others
            say(f"mla-tune: skipping winner row {row.id} ({row.shape_key!r:.80}) of "
                f"{store.url}: {str(e)[:200]}")
    return records


def export_winners(store: TuningStore, path: str | os.PathLike[str],
                   device_hash: str | None = None) -> int:
    """Write the store's winners (all devices, or the one with `device_hash`) to `path`,
    with where each was verified; returns how many were written."""
    records = records_from_store(store, device_hash)
    write_winners_json(records, path)
    return len(records)


@dataclass(frozen=True)
class ImportSummary:
    """What `import_winners` did: entries stored as trials, entries now the winner of their
    shape, and `not_current` entries, stored but unable to win because their backend is
    unknown here or their kernel sources differ from the installed ones (the sweep's rule)."""

    trials: int
    won: int
    not_current: int


def import_winners(store: TuningStore, path: str | os.PathLike[str],
                   records: list[WinnerRecord] | None = None) -> ImportSummary:
    """Store each winner of a file as an 'ok' trial under its own device and stack (and
    its config as a 'wrong' trial at each shape it was stored wrong at; where it was
    verified ok at other shapes is not stored, for a trial there would need a time), then
    recompute
    those shapes' winners, so an imported winner competes with local trials instead of
    overwriting them. Re-importing the same file changes nothing. `records`: the file
    already read with `load_winners_json` (it is not read again)."""
    from mla_tune.backends import source_hash_pairs
    from mla_tune.db import TrialGroup, TrialResult
    from mla_tune.results.selection import update_winner

    if records is None:
        records = load_winners_json(path)
    # A file written before sources were hashed by their code names them by their bytes:
    # such a winner of the installed files is stored under the code hash.
    hashes = source_hash_pairs()
    renamed = {(b, old): new for b, (old, new) in hashes.items()}
    sources = {b: new for b, (_, new) in hashes.items()}
    worker = f"import:{Path(path).name}"[:MAX_TEXT]
    current: dict[tuple[int, int, str], list[WinnerRecord]] = {}
    stale = 0
    device_ids: dict[DeviceFingerprint, int] = {}
    software_ids: dict[SoftwareFingerprint, int] = {}
    for r in records:
        # A file usually holds one device and stack: look each up (a write) once.
        if r.device not in device_ids:
            device_ids[r.device] = store.device_id(r.device)
        if r.software not in software_ids:
            software_ids[r.software] = store.software_id(r.software)
        device_id, software_id = device_ids[r.device], software_ids[r.software]
        r = replace(r, source_hash=renamed.get((r.backend, r.source_hash), r.source_hash))
        group = TrialGroup(device_id, software_id, r.shape.key, r.backend, r.source_hash)
        store.record_trial(group, TrialResult(r.shape.to_json(), r.shape.kv_format.value,
                                              r.config, "ok", {"median_us": r.median_us},
                                              worker=worker))
        for s in r.verified_wrong:  # kept as facts: the dispatcher never runs it there
            store.record_trial(replace(group, shape_key=s.key),
                               TrialResult(s.to_json(), s.kv_format.value, r.config, "wrong",
                                           error=f"stored wrong in {worker}"[:MAX_TEXT],
                                           worker=worker))
        if sources.get(r.backend) != r.source_hash:
            stale += 1
            continue
        current.setdefault((device_id, software_id, r.shape.key), []).append(r)
    won = 0
    for (device_id, software_id, shape_key), mine in sorted(current.items()):
        w = update_winner(store, device_id, software_id, shape_key, sources)
        won += sum(w is not None and (w.backend, w.config) == (r.backend, r.config)
                   for r in mine)
    return ImportSummary(trials=len(records), won=won, not_current=stale)

