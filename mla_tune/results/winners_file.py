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
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mla_tune.machine.fingerprint import DeviceFingerprint, SoftwareFingerprint
from mla_tune.problem.shapes import Shape
from mla_tune.results.winner import MAX_TEXT, Winner, WinnerDataError, parse_shape

if TYPE_CHECKING:
    from mla_tune.db import TuningStore

FORMAT = "mla-tune-winners"
VERSION = 2
READS_VERSIONS = (1, 2)
MAX_FILE_BYTES = 64 * 2**20
MAX_ENTRIES = 100_000

log = logging.getLogger(__name__)

_DOC_KEYS = {"format", "version", "winners"}


class WinnersFileError(ValueError):
    """A winners document that is not exactly what this module writes; the message names
    the offending field."""


def _fail(where: str, message: str) -> WinnersFileError:
    return WinnersFileError(f"{where}: {message}")


def parse_winners(doc: Any) -> list[Winner]:
    """Validate a decoded winners document and return its records, in file order."""
    if not isinstance(doc, dict):
        raise _fail("document", f"expected an object, got {type(doc).__name__}")
    if set(doc) != _DOC_KEYS:
        extra, missing = sorted(set(doc) - _DOC_KEYS), sorted(_DOC_KEYS - set(doc))
        raise _fail("document", f"unexpected keys {extra}" if extra else
                    f"missing keys {missing}")
    d = doc
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
        try:
            r = Winner.from_json(entry, f"winners[{i}]", version)
        except WinnerDataError as e:
            raise WinnersFileError(str(e)) from None
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


def load_winners_json(path: str | os.PathLike[str]) -> list[Winner]:
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


def winners_document(records: list[Winner]) -> dict[str, Any]:
    """The version-1 document for `records` (what `export_winners` writes)."""
    return {"format": FORMAT, "version": VERSION, "winners": [r.to_json() for r in records]}


def write_winners_json(records: list[Winner], path: str | os.PathLike[str]) -> None:
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


def _verification(store: TuningStore, rows: list[Winner]
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
                    shape = parse_shape(t.shape_json, f"trial {t.id} shape")
                except WinnerDataError as e:
                    log.warning("mla-tune: skipping a malformed trial: %s", e)
                    continue
                out.setdefault(key, ({}, {}))[side].setdefault(shape.key, shape)
    return out


def records_from_store(store: TuningStore, device_hash: str | None = None,
                       warn: Callable[[str], None] | None = None,
                       verified_for: str | None = None) -> list[Winner]:
    """The store's winners (all devices, or the one with `device_hash`) as records carrying
    where each config was verified ok / wrong (for every device's winners, or only those of
    device `verified_for`: the others' trials are not read). A winner row that does not
    decode is skipped by the store (logged and listed in `store.skipped`), never the table;
    trials that cannot be read leave the winners without verification facts, said by
    `warn` (default: logged)."""
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
        ok, wrong = facts.get((row.device_id, row.backend, row.source_hash,
                               config_key(row.config)), ({}, {}))
        records.append(replace(row, verified_ok=tuple(ok.values()),
                               verified_wrong=tuple(wrong.values())))
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
                   records: list[Winner] | None = None, *,
                   replace_timings: bool = False) -> ImportSummary:
    """Store each winner of a file as an 'ok' trial under its own device and stack (and
    its config as a 'wrong' trial at each shape it was stored wrong at; where it was
    verified ok at other shapes is not stored, for a trial there would need a time), then
    recompute
    those shapes' winners, so an imported winner competes with local trials instead of
    overwriting them. Re-importing the same file changes nothing. `records`: the file
    already read with `load_winners_json` (it is not read again). `replace_timings`: the
    file's timings supersede the 'ok' trials stored for its winners' shapes on the same
    device, backend and source, under any stack (a re-timing under another protocol):
    they are deleted first and those shapes' winners chosen again; failed, timeout and
    wrong trials stay."""
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
    current: dict[tuple[int, int, str], list[Winner]] = {}
    superseded: set[TrialGroup] = set()
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
        if replace_timings:
            # Every stack's timings of the shape on this device, backend and source.
            for t in store.trials(device_id=device_id, shape_key=r.shape.key,
                                  backend=r.backend, source_hash=r.source_hash, status="ok"):
                g = replace(group, software_id=t.software_id)
                if g not in superseded:
                    superseded.add(g)
                    store.supersede_timings(g)
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
    for g in superseded:  # shapes of other stacks whose winner may have gone
        current.setdefault((g.device_id, g.software_id, g.shape_key), [])
    for (device_id, software_id, shape_key), mine in sorted(current.items()):
        w = update_winner(store, device_id, software_id, shape_key, sources)
        won += sum(w is not None and (w.backend, w.config) == (r.backend, r.config)
                   for r in mine)
    return ImportSummary(trials=len(records), won=won, not_current=stale)

