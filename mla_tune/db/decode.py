"""Decoding stored rows into the plain records of `mla_tune.db.rows`, checking every value.

A tuning DB may be shared, copied, or damaged, so no value is trusted: a row that cannot be
decoded raises RowError (readers skip it with a warning naming it), and a text column is
only parsed when it is small enough that parsing it cannot cost seconds and gigabytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from mla_tune.db import models
from mla_tune.db.models import TRIAL_STATUSES, Device, Software, Trial
from mla_tune.db.rows import TrialRow
from mla_tune.machine.fingerprint import DeviceFingerprint, SoftwareFingerprint
from mla_tune.results.winner import Winner, WinnerDataError

# What a read takes from one row (reports, the dispatcher). A config or a software record
# is well under a KiB; a ragged shape lists up to 2**20 kv lengths (winners_json's cap on a
# batch). Anything larger is damage, and decoding it would cost seconds and gigabytes.
MAX_JSON_CHARS = 64 * 1024
MAX_SHAPE_JSON_CHARS = 12 * 2**20
MAX_TEXT_CHARS = 256
MAX_PACKAGES = 64
MAX_ROW_INT = 1 << 62


def aware(dt: datetime) -> datetime:
    """SQLite returns naive datetimes; all of ours are stored in UTC."""
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=timezone.utc)


class RowError(ValueError):
    """A stored row that cannot be decoded (damaged or written by something else): readers
    skip it with a warning naming it, instead of failing on the whole table."""


def _json_object(value: Any, column: str, limit: int = MAX_JSON_CHARS) -> dict[str, Any]:
    """A JSON object column, decoded only when its text is under `limit` characters."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise RowError(f"{column} is a BLOB of {len(value)} bytes, not JSON text") from None
    if not isinstance(value, str):
        raise RowError(f"{column} is {'NULL' if value is None else type(value).__name__}, "
                       "not JSON text")
    if len(value) > limit:
        raise RowError(f"{column} holds {len(value)} characters, over the {limit} a "
                       "reader takes")
    try:
        decoded = json.loads(value)
    except RecursionError:
        raise RowError(f"{column} is nested too deeply") from None
    except ValueError as e:  # bad JSON, or an integer of thousands of digits
        raise RowError(f"{column} is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(decoded, dict):
        raise RowError(f"{column} is a JSON {type(decoded).__name__}, not an object")
    return decoded


def _text(value: Any, column: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT_CHARS:
        raise RowError(f"{column} is not a text of 1 to {MAX_TEXT_CHARS} characters")
    return value


def _integer(value: Any, column: str, lo: int = 0) -> int:
    if type(value) is not int or not lo <= value <= MAX_ROW_INT:
        raise RowError(f"{column} is not an integer in [{lo}, 2^62]: {str(value)[:40]!r}")
    return value


def _time_us(value: Any, column: str, *, zero: bool = False) -> float | None:
    """An optional time (or spread, with `zero`) in µs: a finite number, positive unless
    `zero`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or abs(value) > MAX_ROW_INT \
            or value < 0 or (value == 0 and not zero):
        what = "non-negative" if zero else "positive"
        raise RowError(f"{column} is not a {what} finite number: {str(value)[:40]!r}")
    return float(value)


def _optional(value: Any, kind: type | tuple[type, ...], column: str) -> Any:
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise RowError(f"{column} is of the wrong type ({type(value).__name__})")
    return value


def _string(value: Any, column: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_JSON_CHARS:
        raise RowError(f"{column} is not a text of at most {MAX_JSON_CHARS} characters")
    return value


def trial_row(t: Trial) -> TrialRow:
    """`t` as plain data; raises RowError for a value no trial can hold."""
    if t.status not in TRIAL_STATUSES:
        raise RowError(f"status {str(t.status)[:40]!r} is not one of {TRIAL_STATUSES}")
    median = _time_us(t.median_us, "median_us")
    if t.status == "ok" and median is None:
        raise RowError("an 'ok' trial without median_us")
    return TrialRow(
        id=t.id, device_id=_integer(t.device_id, "device_id"),
        software_id=_integer(t.software_id, "software_id"),
        shape_key=_text(t.shape_key, "shape_key"),
        shape_json=_json_object(t.shape_json, "shape_json", MAX_SHAPE_JSON_CHARS),
        kv_format=_text(t.kv_format, "kv_format"), backend=_text(t.backend, "backend"),
        source_hash=_text(t.source_hash, "source_hash"),
        config=_json_object(t.config_json, "config_json"),
        config_key=_string(t.config_key, "config_key"), status=t.status,
        median_us=median, mean_us=_time_us(t.mean_us, "mean_us"),
        std_us=_time_us(t.std_us, "std_us", zero=True), min_us=_time_us(t.min_us, "min_us"),
        max_us=_time_us(t.max_us, "max_us"),
        n=None if t.n is None else _integer(t.n, "n", 1),
        max_abs_err=_optional(t.max_abs_err, (int, float), "max_abs_err"),
        mismatch_frac=_optional(t.mismatch_frac, (int, float), "mismatch_frac"),
        error=None if t.error is None else str(t.error)[:MAX_JSON_CHARS],
        worker=None if t.worker is None else str(t.worker)[:MAX_TEXT_CHARS],
        created_at=aware(t.created_at),
        first_median_us=_time_us(t.first_median_us, "first_median_us"),
        runoff_median_us=_time_us(t.runoff_median_us, "runoff_median_us"),
        remeasured_at=None if t.remeasured_at is None else aware(t.remeasured_at),
    )


def _device_fingerprint(d: Device) -> DeviceFingerprint:
    try:
        return DeviceFingerprint(vendor=_text(d.vendor, "device vendor"),
                                 name=_text(d.name, "device name"),
                                 arch=_text(d.arch, "device arch"),
                                 sm_count=_integer(d.sm_count, "device sm_count"),
                                 memory_bytes=_integer(d.memory_bytes, "device memory_bytes"))
    except ValueError as e:  # an unknown vendor
        raise RowError(f"device {d.id}: {e}") from None


def read_bw(d: Device) -> float | None:
    """The device's stored read bandwidth, or None when it is not a positive number."""
    try:
        return _time_us(d.read_bw_gbps, "read_bw_gbps")
    except RowError:
        return None


def winner_row(w: models.Winner, d: Device, s: Software) -> Winner:
    """`w` with its device and stack as a `Winner`; raises RowError for a value no winner
    can hold (a damaged row, or one its device or stack row cannot describe). Its shape,
    config and fingerprints go through the winners file's checks (`Winner.from_json`), so
    a DB and a file are held to one standard."""
    versions = _json_object(s.versions_json, f"software {s.id} versions_json")
    if len(versions) > MAX_PACKAGES or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= MAX_TEXT_CHARS
            and len(v) <= MAX_TEXT_CHARS for k, v in versions.items()):
        raise RowError(f"software {s.id} versions_json is not up to {MAX_PACKAGES} "
                       "package: version texts")
    median = _time_us(w.median_us, "median_us")
    if median is None:
        raise RowError("median_us is NULL")
    _text(w.kv_format, "kv_format")  # the shape carries it; a damaged column is still damage
    try:
        winner = Winner.from_json({
            "device": _device_fingerprint(d).to_json(),
            "software": SoftwareFingerprint.from_json(versions).to_json(),
            "shape": _json_object(w.shape_json, "shape_json", MAX_SHAPE_JSON_CHARS),
            "shape_key": _text(w.shape_key, "shape_key"),
            "backend": _text(w.backend, "backend"),
            "source_hash": _text(w.source_hash, "source_hash"),
            "config": _json_object(w.config_json, "config_json"), "median_us": median})
    except WinnerDataError as e:
        raise RowError(str(e)) from None
    return replace(winner, id=w.id, device_id=w.device_id, software_id=w.software_id,
                   trial_id=_integer(w.trial_id, "trial_id"), updated_at=aware(w.updated_at),
                   device_read_bw_gbps=read_bw(d))
