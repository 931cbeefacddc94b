"""The tuning store: every measured trial and the current winner per (device, stack, shape).

The store knows nothing of kernels: configs and shapes are opaque JSON objects to it, and
everything it hands back is plain frozen data parsed with `json.loads` (a DB file is data,
never code). One SQLite file or one PostgreSQL database may be shared by many tuning
processes and by Optuna's studies, so every write is race-safe and our tables are prefixed.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import logging
import math
import os
import sqlite3
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import (
    URL,
    ColumnElement,
    Connection,
    Engine,
    Float,
    and_,
    cast,
    create_engine,
    delete,
    event,
    exists,
    extract,
    func,
    inspect,
    make_url,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.orm import Session, aliased
from sqlalchemy.pool import NullPool

from mla_tune.db.models import (
    TRIAL_STATUSES,
    VERSION_TABLE,
    Claim,
    Device,
    Software,
    Trial,
    Winner,
    utcnow,
)
from mla_tune.fingerprint import DeviceFingerprint, SoftwareFingerprint
from mla_tune.space import config_key

if TYPE_CHECKING:
    from optuna.storages import RDBStorage

ENV_VAR = "MLA_TUNE_DB"
DEFAULT_URL = "sqlite:///tuning.db"
# `--db shipped`: the tuning results shipped with mla-tune, read-only (see shipped_db_url).
SHIPPED = "shipped"
SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 30
# A read-only opener never waits on a writer under WAL; this only bounds odd cases (a DB
# left in rollback-journal mode, WAL recovery) so a serving process is never held for long.
READ_ONLY_BUSY_TIMEOUT_S = 5
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
STAT_KEYS = ("median_us", "mean_us", "std_us", "min_us", "max_us", "n")
_TRIAL_KEY = ("device_id", "software_id", "shape_key", "backend", "source_hash", "config_key")
_WINNER_KEY = ("device_id", "software_id", "shape_key")
_GROUP_KEY = ("device_id", "software_id", "shape_key", "backend", "source_hash")
# Optuna creates its tables without a lock; a process racing another on a fresh DB fails
# with "already exists" (or a lock error) and succeeds when it tries again.
_OPTUNA_OPEN_ATTEMPTS = 5
log = logging.getLogger(__name__)
# What a read takes from one row (reports, the dispatcher). A config or a software record
# is well under a KiB; a ragged shape lists up to 2**20 kv lengths (winners_json's cap on a
# batch). Anything larger is damage, and decoding it would cost seconds and gigabytes.
MAX_JSON_CHARS = 64 * 1024
MAX_SHAPE_JSON_CHARS = 12 * 2**20
MAX_TEXT_CHARS = 256
MAX_PACKAGES = 64
MAX_ROW_INT = 1 << 62


class DBError(RuntimeError):
    """The tuning DB cannot be used as given; the message says why and what to do."""


class _ChangedWhileReading(Exception):
    """A read of a cleanly closed SQLite file (opened immutable) saw the file change."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _writes(method: _F) -> _F:
    """Refuse `method` on a read-only store, before touching the DB."""
    @functools.wraps(method)
    def wrapper(self: TuningStore, *args: Any, **kwargs: Any) -> Any:
        if self.read_only:
            raise DBError(f"cannot {method.__name__}: the tuning DB {self.url} was opened "
                          "read-only; open it with TuningStore(url) (read_only=False) to "
                          "write")
        return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def _reads(method: _F) -> _F:
    """Run `method` again when a lock-free read saw the file change under it."""
    @functools.wraps(method)
    def wrapper(self: TuningStore, *args: Any, **kwargs: Any) -> Any:
        for _ in range(3):
            try:
                return method(self, *args, **kwargs)
            except _ChangedWhileReading:
                continue
        self._lock_free = False  # a writer is busy: read through WAL's shared memory
        return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class DeviceRow:
    """A device known to the DB, with its measured read bandwidth if any."""

    id: int
    hash: str
    fingerprint: DeviceFingerprint
    read_bw_gbps: float | None
    created_at: datetime


@dataclass(frozen=True)
class TrialRow:
    """One measured (or failed) config, detached from any DB session."""

    id: int
    device_id: int
    software_id: int
    shape_key: str
    shape_json: dict[str, Any]
    kv_format: str
    backend: str
    source_hash: str
    config: dict[str, Any]
    config_key: str
    status: str
    median_us: float | None
    mean_us: float | None
    std_us: float | None
    min_us: float | None
    max_us: float | None
    n: int | None
    max_abs_err: float | None
    mismatch_frac: float | None
    error: str | None
    worker: str | None
    created_at: datetime
    first_median_us: float | None = None
    runoff_median_us: float | None = None
    remeasured_at: datetime | None = None


@dataclass(frozen=True)
class TrialGroup:
    """The candidates of one backend for one tuning key: what a sweep queues and claims."""

    device_id: int
    software_id: int
    shape_key: str
    backend: str
    source_hash: str

    def where(self, model: type[Trial] | type[Claim]) -> list[ColumnElement[bool]]:
        return [getattr(model, k) == getattr(self, k) for k in _GROUP_KEY]


@dataclass(frozen=True)
class ClaimRow:
    """A candidate queued (`pending`) or being measured (`running`) and not yet stored."""

    config: dict[str, Any]
    config_key: str
    state: str
    claimed_by: str | None
    heartbeat_age_s: float | None


@dataclass(frozen=True)
class SourceRow:
    """The trials stored for one kernel source of one backend (all devices and stacks)."""

    backend: str
    source_hash: str
    trials: int
    newest_trial_id: int
    named_by_winners: int


@dataclass(frozen=True)
class DeletedRows:
    """What `delete_sources` removed, and the trials it kept because a winner names them."""

    trials: int
    claims: int
    kept_for_winners: int


@dataclass(frozen=True)
class RenamedRows:
    """What `rename_source` moved to the new source hash, and the trials it left under the
    old one (the new hash already had a trial of the same key)."""

    trials: int
    winners: int
    claims: int
    left: int


@dataclass(frozen=True)
class WinnerRow:
    """The fastest correct config for a shape, with the device and stack it was tuned on,
    so the dispatcher and reports need no further queries."""

    id: int
    device_id: int
    software_id: int
    device: DeviceFingerprint
    device_read_bw_gbps: float | None
    software: SoftwareFingerprint
    shape_key: str
    shape_json: dict[str, Any]
    kv_format: str
    backend: str
    source_hash: str
    config: dict[str, Any]
    trial_id: int
    median_us: float
    updated_at: datetime


def shipped_db_path() -> Path:
    """The H200 results shipped with mla-tune: found through the installed package, never
    the working directory."""
    import mla_tune.shipped

    return Path(mla_tune.shipped.__file__).resolve().parent / "tuning.db"


def default_db_path() -> Path | None:
    """The user's default SQLite file (./tuning.db) when $MLA_TUNE_DB names no DB, else
    None: where `resolve_url(None)` points when nothing else was asked for."""
    if os.environ.get(ENV_VAR):
        return None
    return Path(make_url(DEFAULT_URL).database or "")


def shipped_db_url() -> str:
    """SQLite URL of the shipped results (`--db shipped`). It is data of the installation:
    open it with `TuningStore(url, read_only=True)`, which reads it without writing a byte,
    even in a read-only site-packages."""
    return URL.create("sqlite", database=str(shipped_db_path())).render_as_string()


def _raw_url(url: str | None) -> str:
    return url or os.environ.get(ENV_VAR) or DEFAULT_URL


def resolve_url(url: str | None = None) -> URL:
    """`url`, else $MLA_TUNE_DB, else ./tuning.db; a bare path means a SQLite file, and
    `shipped` the results shipped with mla-tune (`./shipped` is a file of that name)."""
    raw = _raw_url(url)
    if raw == SHIPPED:
        return URL.create("sqlite", database=str(shipped_db_path()))
    if "://" not in raw:
        return URL.create("sqlite", database=str(Path(raw).expanduser()))
    try:
        parsed = make_url(raw)
    except ArgumentError as e:
        raise DBError(f"bad database URL {raw!r}: {e}") from None
    if parsed.drivername == "postgresql":  # psycopg 3 is the driver we ship with
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DBError(f"unsupported database {parsed.get_backend_name()!r} in "
                      f"{parsed.render_as_string()}; use sqlite:///PATH or "
                      "postgresql+psycopg://USER:PASSWORD@HOST/DB")
    return parsed


# SQLite's primary result codes and PostgreSQL's SQLSTATEs that say the DB's storage, not
# the statement, failed: the disk is full, the file is damaged or cannot be written.
_FULL, _DAMAGED, _IO, _READ_ONLY, _CANT_OPEN = "full", "damaged", "io", "read-only", "cantopen"
_SQLITE_CODES = {sqlite3.SQLITE_FULL: _FULL, sqlite3.SQLITE_CORRUPT: _DAMAGED,
                 sqlite3.SQLITE_NOTADB: _DAMAGED, sqlite3.SQLITE_IOERR: _IO,
                 sqlite3.SQLITE_READONLY: _READ_ONLY, sqlite3.SQLITE_CANTOPEN: _CANT_OPEN}
_PG_STATES = {"53100": _FULL, "XX001": _DAMAGED, "XX002": _DAMAGED, "58030": _IO,
              "25006": _READ_ONLY}
_KEPT = ("Nothing stored was lost: the write in progress was rolled back and everything "
         "stored before it is kept.")


def _storage_failure(kind: str, url: str, detail: str) -> DBError:
    if kind == _FULL:
        return DBError(f"the disk holding the tuning DB {url} is full ({detail}). {_KEPT} "
                       "Free some space (or give --db a DB on another disk) and run the "
                       "same command again to finish.")
    if kind == _DAMAGED:
        return DBError(f"the tuning DB {url} is damaged ({detail}). {_KEPT} Keep the file "
                       "as it is and write no more to it: restore a backup, or copy out "
                       "what is readable (for a SQLite file: `sqlite3 DAMAGED.db .recover "
                       "| sqlite3 recovered.db`), and sweep with --db pointing at the "
                       "restored DB or a new one.")
    if kind == _IO:
        return DBError(f"the tuning DB {url} could not be read or written: the operating "
                       f"system reported an I/O error ({detail}), e.g. a full disk, a file "
                       f"size limit or a failing device. {_KEPT} Fix the cause and run the "
                       "same command again.")
    if kind == _READ_ONLY:
        return DBError(f"the tuning DB {url} cannot be written ({detail}): the file, its "
                       "directory or the server is read-only. Fix the permissions or give "
                       "--db a writable DB; report, diff and export read it as it is.")
    return DBError(f"cannot open the tuning DB {url} ({detail}); check that its directory "
                   "exists and can be written, or give --db another path.")


def db_failure(exc: BaseException, url: str) -> DBError | None:
    """The DBError to show when `exc`, or an exception it was raised from, means the DB's
    storage failed (disk full, damaged file, I/O error, read-only); None for any other
    error. Both databases roll the failed transaction back, so what was stored stays."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DBError):
            return e
        kind = None
        if isinstance(e, sqlite3.Error):
            kind = _SQLITE_CODES.get((getattr(e, "sqlite_errorcode", None) or 0) & 0xFF)
        elif isinstance(getattr(e, "sqlstate", None), str):  # a psycopg error
            kind = _PG_STATES.get(e.sqlstate)  # type: ignore[attr-defined]
        if kind is not None:
            return _storage_failure(kind, url, str(e).strip().splitlines()[0] if str(e)
                                    else type(e).__name__)
        e = e.__cause__ or e.__context__
    return None


def _check_sqlite_file(database: str | None) -> None:
    """Refuse, without writing a byte, a path that is not a SQLite DB we can use."""
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    if path.is_dir():
        raise DBError(f"{path} is a directory, not a SQLite database file; "
                      f"pass a file path instead, e.g. {path / 'tuning.db'}")
    if not path.exists():
        parent = path.absolute().parent
        if not parent.is_dir():
            raise DBError(f"cannot create the tuning DB {path}: {parent} is not an existing "
                          "directory; create it first or choose another path")
        return
    try:
        with path.open("rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except OSError as e:
        raise DBError(f"cannot read the tuning DB {path}: {e.strerror or e}; fix its "
                      "permissions or choose another path") from None
    if header and header != SQLITE_HEADER:
        raise DBError(f"{path} exists but is not a SQLite database (it starts with "
                      f"{header!r}); it was left untouched. Choose another path, or move "
                      "the file away if it is a damaged tuning DB")


def _enable_wal(cur: sqlite3.Cursor) -> None:
    """Switch to WAL, retrying: while another connection switches the same fresh file,
    SQLite reports "database is locked" at once instead of waiting busy_timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _sqlite_on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    # We emit BEGIN ourselves (see _sqlite_on_begin); pysqlite's implicit transactions
    # would autocommit DDL and let migrations interleave.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    try:
        cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
        _enable_wal(cur)
        cur.execute("PRAGMA foreign_keys = ON")
    finally:
        cur.close()


def _sqlite_on_begin(conn: Connection) -> None:
    # Take the write lock up front: a deferred transaction that later writes can fail at
    # once with "database is locked" under WAL, while IMMEDIATE waits busy_timeout.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def _sqlite_on_connect_read_only(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # BEGIN is ours (deferred: a reader takes no lock)
    cur = dbapi_conn.cursor()
    try:
        cur.execute(f"PRAGMA busy_timeout = {READ_ONLY_BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA query_only = ON")
    finally:
        cur.close()


def _sqlite_on_begin_read_only(conn: Connection) -> None:
    # One snapshot per session, and no write lock: a sweep's BEGIN IMMEDIATE never blocks
    # a WAL reader.
    conn.exec_driver_sql("BEGIN")


class _ReadOnlyConnection(sqlite3.Connection):
    """A read-only SQLite connection; `clean_state` is set when it was opened lock-free."""

    clean_state: tuple[int, int, int] | None = None


def _clean_state(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of a SQLite file no connection has open (no -wal file next to
    it), else None."""
    if Path(f"{path}-wal").exists():
        return None
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _lock_key(*parts: object) -> int:
    """A signed 64-bit PostgreSQL advisory lock id for `parts`."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _aware(dt: datetime) -> datetime:
    """SQLite returns naive datetimes; all of ours are stored in UTC."""
    return dt if dt.tzinfo is not None else dt.replace(tzinfo=timezone.utc)


def _named_by_a_winner() -> ColumnElement[bool]:
    """A trial some stored winner points at (such trials are never deleted)."""
    return exists().where(Winner.trial_id == Trial.id)


def _rekey(s: Session, model: type[Trial] | type[Claim], backend: str, old: str,
           new: str) -> int:
    """Move rows of `model` from source `old` to `new` where `new` has no row of the same
    unique key (device, stack, shape, backend, config)."""
    other = aliased(model)
    clash = exists().where(
        other.device_id == model.device_id, other.software_id == model.software_id,
        other.shape_key == model.shape_key, other.backend == model.backend,
        other.config_key == model.config_key, other.source_hash == new)
    return s.execute(update(model).where(model.backend == backend, model.source_hash == old,
                                         ~clash).values(source_hash=new)).rowcount


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


def _trial_row(t: Trial) -> TrialRow:
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
        created_at=_aware(t.created_at),
        first_median_us=_time_us(t.first_median_us, "first_median_us"),
        runoff_median_us=_time_us(t.runoff_median_us, "runoff_median_us"),
        remeasured_at=None if t.remeasured_at is None else _aware(t.remeasured_at),
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


def _read_bw(d: Device) -> float | None:
    """The device's stored read bandwidth, or None when it is not a positive number."""
    try:
        return _time_us(d.read_bw_gbps, "read_bw_gbps")
    except RowError:
        return None


def _winner_row(w: Winner, d: Device, s: Software) -> WinnerRow:
    """`w` with its device and stack as plain data; raises RowError for a value no winner
    can hold (a damaged row, or one its device or stack row cannot describe)."""
    versions = _json_object(s.versions_json, f"software {s.id} versions_json")
    if len(versions) > MAX_PACKAGES or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= MAX_TEXT_CHARS
            and len(v) <= MAX_TEXT_CHARS for k, v in versions.items()):
        raise RowError(f"software {s.id} versions_json is not up to {MAX_PACKAGES} "
                       "package: version texts")
    median = _time_us(w.median_us, "median_us")
    if median is None:
        raise RowError("median_us is NULL")
    return WinnerRow(
        id=w.id, device_id=w.device_id, software_id=w.software_id,
        device=_device_fingerprint(d), device_read_bw_gbps=_read_bw(d),
        software=SoftwareFingerprint.from_json(versions),
        shape_key=_text(w.shape_key, "shape_key"),
        shape_json=_json_object(w.shape_json, "shape_json", MAX_SHAPE_JSON_CHARS),
        kv_format=_text(w.kv_format, "kv_format"), backend=_text(w.backend, "backend"),
        source_hash=_text(w.source_hash, "source_hash"),
        config=_json_object(w.config_json, "config_json"),
        trial_id=_integer(w.trial_id, "trial_id"), median_us=median,
        updated_at=_aware(w.updated_at),
    )


class TuningStore:
    """Tuning results in SQLite or PostgreSQL; the schema is migrated to head on open.

    With `read_only=True` (reports, diff, export, the dispatcher) the DB is only read: it
    must exist and be at this mla-tune's schema revision (no migration runs), a SQLite file
    is opened with `mode=ro` (no WAL switch, no write lock, nothing created), PostgreSQL
    transactions are READ ONLY, and every write method raises DBError. A SQLite file that
    no process has open (no -wal file next to it) is read without locks or -wal/-shm files
    (`immutable=1`, retried through WAL's shared memory if the file changes meanwhile), so
    a DB in a read-only directory can be read and no read leaves files behind."""

    def __init__(self, url: str | None = None, *, read_only: bool = False) -> None:
        if not read_only and _raw_url(url) == SHIPPED:
            raise DBError("`shipped` names the tuning results shipped with mla-tune, which "
                          "are only read; sweep into your own DB (the default ./tuning.db, "
                          "or --db PATH). To add to the shipped results on purpose, give "
                          f"the file's path: --db {shipped_db_path()}")
        self._url = resolve_url(url)
        self._dialect = self._url.get_backend_name()
        self.read_only = read_only
        self._ro_path: Path | None = None
        self._lock_free = True
        self._engine: Engine
        if read_only:
            self._engine = self._read_only_engine()
        elif self._dialect == "sqlite":
            _check_sqlite_file(self._url.database)
            self._engine = create_engine(self._url)
            event.listen(self._engine, "connect", _sqlite_on_connect)
            event.listen(self._engine, "begin", _sqlite_on_begin)
        else:
            self._engine = create_engine(self._url, pool_pre_ping=True)
        try:
            if read_only:
                self._check_revision()
            else:
                self._migrate()
        except BaseException:
            self._engine.dispose()
            raise

    def _read_only_engine(self) -> Engine:
        if self._dialect == "postgresql":
            return create_engine(self._url, pool_pre_ping=True).execution_options(
                postgresql_readonly=True)
        database = self._url.database or ""
        if database in ("", ":memory:"):
            raise DBError("an in-memory SQLite DB is empty: give the path of a tuning DB "
                          "file to read")
        if database.startswith("file:"):  # the caller's own URI, e.g. with mode=ro
            engine = create_engine(self._url)
        else:
            _check_sqlite_file(database)
            path = Path(database)
            if not path.is_file():
                raise DBError(f"no tuning DB file at {path}: run `mla-tune sweep` first "
                              "(it creates the DB), or check --db / $MLA_TUNE_DB")
            self._ro_path = path.absolute()
            engine = create_engine("sqlite://", creator=self._connect_read_only,
                                   poolclass=NullPool)
        event.listen(engine, "connect", _sqlite_on_connect_read_only)
        event.listen(engine, "begin", _sqlite_on_begin_read_only)
        return engine

    def _connect_read_only(self) -> sqlite3.Connection:
        assert self._ro_path is not None
        state = _clean_state(self._ro_path) if self._lock_free else None
        uri = f"file:{quote(str(self._ro_path))}?mode=ro" + ("&immutable=1" if state else "")
        conn = sqlite3.connect(uri, uri=True, timeout=READ_ONLY_BUSY_TIMEOUT_S,
                               check_same_thread=False, factory=_ReadOnlyConnection)
        conn.clean_state = state
        return conn

    @_reads
    def _check_revision(self) -> None:
        """Refuse a DB whose schema is not this mla-tune's head (read-only: no upgrade)."""
        script = ScriptDirectory(str(MIGRATIONS_DIR))
        head = script.get_current_head()
        try:
            with self._session() as s:
                found = inspect(s.connection()).has_table(VERSION_TABLE)
                revs = (s.scalars(text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
                        if found else [])
        except DBAPIError as e:
            raise DBError(f"cannot read the tuning DB {self.url}: {e.orig or e}") from None
        if not found:
            raise DBError(f"{self.url} has no mla-tune tables (it is empty or not a tuning "
                          "DB); run `mla-tune sweep` on it first, or check --db / "
                          "$MLA_TUNE_DB")
        if revs == [head]:
            return
        known = {r.revision for r in script.walk_revisions()}
        rev = ", ".join(revs) or "(none)"
        if all(r in known for r in revs):
            raise DBError(f"the tuning DB {self.url} is at schema revision {rev}, older than "
                          f"this mla-tune's {head}, and a read-only open does not upgrade it; "
                          "run any `mla-tune sweep` on it (e.g. `mla-tune sweep --shape "
                          "4x1024 --db ...`) to upgrade it, then retry")
        raise DBError(f"the tuning DB {self.url} is at schema revision {rev}, which this "
                      f"mla-tune (schema {head}) does not know: it was written by a newer "
                      "mla-tune; upgrade mla-tune to read it")

    @property
    def url(self) -> str:
        """The database URL with any password masked, for messages and reports."""
        return self._url.render_as_string(hide_password=True)

    def close(self) -> None:
        """Release pooled connections (and SQLite file handles)."""
        self._engine.dispose()

    def __enter__(self) -> "TuningStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _migrate(self) -> None:
        """Upgrade our tables to head, one process at a time: the SQLite write lock or a
        PostgreSQL advisory lock is held for the whole upgrade, so concurrent openers of a
        fresh DB never race to create the same table."""
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
        try:
            with self._engine.begin() as conn:
                if self._dialect == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"),
                                 {"k": _lock_key("mla-tune migrations")})
                else:
                    self._check_integrity(conn)
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
        except CommandError as e:
            raise DBError(f"cannot migrate the tuning DB {self.url}: {e}. It was probably "
                          "written by a newer mla-tune; upgrade mla-tune or use another "
                          "DB") from None
        except DBAPIError as e:
            raise (db_failure(e, self.url)
                   or DBError(f"cannot open the tuning DB {self.url}: {e.orig or e}")) from None

    def _check_integrity(self, conn: Connection) -> None:
        """Refuse a damaged SQLite file before writing to it: a sweep would otherwise fail
        at the first damaged page it meets, with its new results stored next to them."""
        problems = [str(r[0]) for r in conn.exec_driver_sql("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise DBError(f"the tuning DB {self.url} is damaged (SQLite's check: "
                          f"{'; '.join(problems)}); nothing was written to it. Keep the file "
                          "as it is: restore a backup, or copy out what is readable with "
                          "`sqlite3 DAMAGED.db .recover | sqlite3 recovered.db`, and sweep "
                          "with --db pointing at the restored DB or a new one.")

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """One transaction. On a writable store, a failure of the DB's storage (disk full,
        damaged file) is a DBError saying what to do (see `db_failure`)."""
        try:
            with Session(self._engine, expire_on_commit=False) as session, session.begin():
                if self._ro_path is None:
                    yield session
                    return
                # A lock-free read (see the class docstring) must not have seen a change.
                dbapi = session.connection().connection.dbapi_connection
                state = getattr(dbapi, "clean_state", None)
                try:
                    yield session
                except DBAPIError:
                    if state is not None and _clean_state(self._ro_path) != state:
                        raise _ChangedWhileReading from None
                    raise
                if state is not None and _clean_state(self._ro_path) != state:
                    raise _ChangedWhileReading
        except DBAPIError as e:
            failure = None if self.read_only else db_failure(e, self.url)
            if failure is None:
                raise
            raise failure from e

    def _insert(self, model: type[Any]) -> Any:
        dialect = sqlite if self._dialect == "sqlite" else postgresql
        return dialect.insert(model)

    @_writes
    def device_id(self, fp: DeviceFingerprint) -> int:
        """Id of the device row for `fp`, created on first sight (safe under concurrency)."""
        with self._session() as s:
            s.execute(self._insert(Device).values(
                hash=fp.hash, vendor=fp.vendor, name=fp.name, arch=fp.arch,
                sm_count=fp.sm_count, memory_bytes=fp.memory_bytes, created_at=utcnow(),
            ).on_conflict_do_nothing(index_elements=["hash"]))
            return s.execute(select(Device.id).where(Device.hash == fp.hash)).scalar_one()

    @_writes
    def software_id(self, fp: SoftwareFingerprint) -> int:
        """Id of the software-stack row for `fp`, created on first sight."""
        with self._session() as s:
            s.execute(self._insert(Software).values(
                hash=fp.hash, versions_json=config_key(fp.to_json()),
            ).on_conflict_do_nothing(index_elements=["hash"]))
            return s.execute(select(Software.id).where(Software.hash == fp.hash)).scalar_one()

    @_reads
    def devices(self) -> list[DeviceRow]:
        """All devices, oldest first."""
        with self._session() as s:
            return [DeviceRow(id=d.id, hash=d.hash,
                              fingerprint=DeviceFingerprint(d.vendor, d.name, d.arch,
                                                            d.sm_count, d.memory_bytes),
                              read_bw_gbps=d.read_bw_gbps, created_at=_aware(d.created_at))
                    for d in s.scalars(select(Device).order_by(Device.id))]

    @_writes
    def set_read_bandwidth(self, device_id: int, gbps: float) -> None:
        """Store the measured streaming-read bandwidth, the roofline for reports."""
        if not (math.isfinite(gbps) and gbps > 0):
            raise ValueError(f"read bandwidth must be a positive number of GB/s, got {gbps}")
        with self._session() as s:
            result = s.execute(update(Device).where(Device.id == device_id)
                               .values(read_bw_gbps=float(gbps)))
            if result.rowcount == 0:
                raise KeyError(f"no device with id {device_id}")

    @_writes
    def record_trial(self, *, device_id: int, software_id: int, shape_key: str,
                     shape_json: Mapping[str, Any], kv_format: str, backend: str,
                     source_hash: str, config: Mapping[str, Any], status: str,
                     stats: Mapping[str, float | int | None] | None = None,
                     max_abs_err: float | None = None, mismatch_frac: float | None = None,
                     error: str | None = None, worker: str | None = None) -> int:
        """Store one trial and return its id. A trial with the same key (device, stack,
        shape, backend, sources, config) is kept as it is and its id returned, so re-running
        or two workers racing on one config never produce duplicates. The candidate's claim
        (see `claim`) is released in the same transaction: a killed sweep leaves a candidate
        either claimed or stored, never both or neither."""
        if status not in TRIAL_STATUSES:
            raise ValueError(f"status must be one of {TRIAL_STATUSES}, got {status!r}")
        stats = dict(stats or {})
        unknown = set(stats) - set(STAT_KEYS)
        if unknown:
            raise ValueError(f"unknown timing stat(s) {sorted(unknown)}; expected {STAT_KEYS}")
        median = stats.get("median_us")
        if status == "ok" and (median is None or not math.isfinite(median)):
            raise ValueError(f"an 'ok' trial needs a finite median_us, got {median!r}")
        ckey = config_key(config)  # the key is the config's canonical JSON, stored as both
        key = {"device_id": device_id, "software_id": software_id, "shape_key": shape_key,
               "backend": backend, "source_hash": source_hash, "config_key": ckey}
        kv = kv_format.value if isinstance(kv_format, enum.Enum) else str(kv_format)
        with self._session() as s:
            self._lock_group(s, TrialGroup(device_id, software_id, shape_key, backend,
                                           source_hash), shared=True)
            s.execute(self._insert(Trial).values(
                **key, shape_json=config_key(shape_json), kv_format=kv, config_json=ckey,
                status=status, **{k: stats.get(k) for k in STAT_KEYS},
                max_abs_err=max_abs_err, mismatch_frac=mismatch_frac, error=error,
                worker=worker, created_at=utcnow(),
            ).on_conflict_do_nothing(index_elements=list(_TRIAL_KEY)))
            s.execute(delete(Claim).where(*(getattr(Claim, k) == v for k, v in key.items())))
            where = [getattr(Trial, k) == v for k, v in key.items()]
            return s.execute(select(Trial.id).where(*where)).scalar_one()

    @_writes
    def record_remeasure(self, results: Mapping[int, Mapping[str, float | int]]) -> datetime:
        """Store the side-by-side re-timing of a shape's finalists, {trial id: stats}, in one
        transaction. Each trial keeps the statistics of its better timing (lower median),
        its first median in `first_median_us`, this timing's in `runoff_median_us`, and the
        same `remeasured_at` as the others, which is returned. Only 'ok' trials can be
        re-timed.

        The better of two timings, because each can be spoiled, in opposite ways: a first
        one by a slow moment of the device (finalists timed one by one), a re-timing by a
        slow moment of one variant's launches (seen on the H200 for a few small-shape
        variants)."""
        for tid, stats in results.items():
            median = stats.get("median_us")
            if set(stats) != set(STAT_KEYS) or median is None or not math.isfinite(median):
                raise ValueError(f"trial {tid}: re-timing needs finite stats {STAT_KEYS}, "
                                 f"got {dict(stats)}")
        now = utcnow()
        with self._session() as s:
            trials = {t.id: t for t in s.scalars(select(Trial).where(Trial.id.in_(results)))}
            for tid, stats in results.items():
                t = trials.get(tid)
                if t is None or t.status != "ok":
                    raise ValueError(f"trial {tid} is not a stored 'ok' trial; only those "
                                     "can be re-timed")
                if t.first_median_us is None:
                    t.first_median_us = t.median_us
                t.runoff_median_us = float(stats["median_us"])
                if t.median_us is None or stats["median_us"] < t.median_us:
                    for k in STAT_KEYS:
                        setattr(t, k, stats[k])
                t.remeasured_at = now
        return now

    @_writes
    def mark_wrong(self, trial_id: int, error: str, max_abs_err: float | None = None,
                   mismatch_frac: float | None = None) -> None:
        """Turn an 'ok' trial whose variant later failed the check (built again for a
        side-by-side re-timing) into a 'wrong' one, so no winner is ever picked from it;
        its first median is kept in `first_median_us`."""
        with self._session() as s:
            t = s.get(Trial, trial_id)
            if t is None or t.status != "ok":
                raise ValueError(f"trial {trial_id} is not a stored 'ok' trial")
            if t.first_median_us is None:
                t.first_median_us = t.median_us
            for k in STAT_KEYS:
                setattr(t, k, None)
            t.status, t.error = "wrong", error[:2000]
            t.max_abs_err, t.mismatch_frac = max_abs_err, mismatch_frac

    def _db_now(self) -> ColumnElement[float]:
        """Seconds since the epoch by the database's clock: heartbeats written from several
        machines are compared on one clock."""
        if self._dialect == "postgresql":
            return cast(extract("epoch", func.now()), Float)
        return (func.julianday("now") - 2440587.5) * 86400.0

    def _unmeasured(self) -> ColumnElement[bool]:
        """Claims whose candidate has no trial yet."""
        return ~exists().where(*(getattr(Trial, k) == getattr(Claim, k) for k in _TRIAL_KEY))

    def _lock_group(self, s: Session, group: TrialGroup, *, shared: bool = False) -> None:
        """PostgreSQL: order queueing a candidate (exclusive) against storing a trial of the
        group (shared), so no claim is queued for a trial stored in the meantime. SQLite's
        BEGIN IMMEDIATE already serializes every writer."""
        if self._dialect != "postgresql":
            return
        fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        s.execute(text(f"SELECT {fn}(:k)"),
                  {"k": _lock_key("claims", *(getattr(group, k) for k in _GROUP_KEY))})

    def _spent(self, s: Session, group: TrialGroup, stale_after_s: float,
               dead_owners: Collection[str]) -> int:
        """Configs of `group` measured or being measured by a live holder, by any sweep."""
        live = [Claim.state == "running", Claim.heartbeat_at >= self._db_now() - stale_after_s,
                self._unmeasured()]
        if dead_owners:
            live.append(Claim.claimed_by.not_in(sorted(dead_owners)))
        trials = s.scalar(select(func.count()).select_from(Trial).where(*group.where(Trial)))
        held = s.scalar(select(func.count()).select_from(Claim).where(*group.where(Claim),
                                                                       *live))
        return int(trials or 0) + int(held or 0)

    @_reads
    def spent(self, group: TrialGroup, *, stale_after_s: float,
              dead_owners: Collection[str] = ()) -> int:
        """What counts against a `--budget` of `group`, whichever sweep spent it: its stored
        trials plus its candidates being measured by holders that are alive (heartbeat
        within `stale_after_s`, not in `dead_owners`)."""
        with self._session() as s:
            return self._spent(s, group, stale_after_s, dead_owners)

    @_writes
    def enqueue(self, group: TrialGroup, configs: Iterable[Mapping[str, Any]]) -> None:
        """Queue candidates of `group` for measurement, in order; measured or already
        queued ones are left alone."""
        keys = dict.fromkeys(config_key(c) for c in configs)  # canonical JSON, in order
        with self._session() as s:
            self._lock_group(s, group)
            measured = set(s.scalars(select(Trial.config_key).where(*group.where(Trial))))
            values = [{**{k: getattr(group, k) for k in _GROUP_KEY}, "config_key": c,
                       "config_json": c, "state": "pending", "created_at": utcnow()}
                      for c in keys if c not in measured]
            if values:
                s.execute(self._insert(Claim)
                          .on_conflict_do_nothing(index_elements=list(_TRIAL_KEY)), values)

    @_writes
    def claim(self, group: TrialGroup, owner: str, *, stale_after_s: float,
              dead_owners: Collection[str] = (), config: Mapping[str, Any] | None = None,
              budget: int | None = None) -> dict[str, Any] | None:
        """Atomically take one unmeasured candidate of `group` for `owner`: the oldest
        queued one, or one whose owner has not heartbeated for `stale_after_s` seconds or is
        in `dead_owners`. With `config`, that config is queued if it is not measured yet,
        and only it may be taken. With `budget`, nothing is taken once `spent` reaches it,
        so concurrent sweeps together measure at most `budget` configs of the group.
        Returns the config, or None when nothing is claimable.

        PostgreSQL locks the row with FOR UPDATE SKIP LOCKED, so concurrent claimers take
        different rows without waiting (claims that queue a config or count a budget take
        the group's lock first); SQLite's BEGIN IMMEDIATE serializes claimers."""
        now = self._db_now()
        claimable = [Claim.state == "pending", Claim.heartbeat_at < now - stale_after_s]
        if dead_owners:
            claimable.append(Claim.claimed_by.in_(sorted(dead_owners)))
        query = (select(Claim.id, Claim.config_json)
                 .where(*group.where(Claim), or_(*claimable), self._unmeasured())
                 .order_by(Claim.id).limit(1).with_for_update(skip_locked=True, of=Claim))
        with self._session() as s:
            if config is not None or budget is not None:
                self._lock_group(s, group)
            if budget is not None and self._spent(s, group, stale_after_s,
                                                  dead_owners) >= budget:
                return None
            if config is not None:
                key = config_key(config)
                if s.scalar(select(exists().where(*group.where(Trial),
                                                  Trial.config_key == key))):
                    return None
                s.execute(self._insert(Claim).values(
                    **{k: getattr(group, k) for k in _GROUP_KEY}, config_key=key,
                    config_json=key, state="pending", created_at=utcnow(),
                ).on_conflict_do_nothing(index_elements=list(_TRIAL_KEY)))
                query = query.where(Claim.config_key == key)
            row = s.execute(query).first()
            if row is None:
                return None
            s.execute(update(Claim).where(Claim.id == row.id)
                      .values(state="running", claimed_by=owner, heartbeat_at=now))
            return json.loads(row.config_json)

    @_writes
    def heartbeat(self, owner: str) -> int:
        """Mark `owner`'s running claims alive; returns how many it holds."""
        with self._session() as s:
            result = s.execute(update(Claim)
                               .where(Claim.claimed_by == owner, Claim.state == "running")
                               .values(heartbeat_at=self._db_now()))
            return result.rowcount or 0

    @_writes
    def release(self, owner: str) -> int:
        """Put `owner`'s running claims back in the queue (a clean stop), so the next
        sweep takes them at once instead of waiting for them to go stale."""
        with self._session() as s:
            result = s.execute(update(Claim)
                               .where(Claim.claimed_by == owner, Claim.state == "running")
                               .values(state="pending", claimed_by=None, heartbeat_at=None))
            return result.rowcount or 0

    @_reads
    def claims(self, group: TrialGroup) -> list[ClaimRow]:
        """Queued and running candidates of `group` that are not measured yet, oldest
        first."""
        age = (self._db_now() - Claim.heartbeat_at).label("age")
        with self._session() as s:
            rows = s.execute(select(Claim, age)
                             .where(*group.where(Claim), self._unmeasured())
                             .order_by(Claim.id)).all()
            return [ClaimRow(config=json.loads(c.config_json), config_key=c.config_key,
                             state=c.state, claimed_by=c.claimed_by, heartbeat_age_s=a)
                    for c, a in rows]

    def measured(self, device_id: int, software_id: int, shape_key: str, backend: str,
                 source_hash: str) -> dict[str, TrialRow]:
        """Trials already stored for these sources, by config_key, so a resumed search
        skips every config it has seen, whatever its outcome."""
        rows = self.trials(device_id=device_id, software_id=software_id, shape_key=shape_key,
                           backend=backend, source_hash=source_hash)
        return {r.config_key: r for r in rows}

    @_reads
    def trials(self, *, device_id: int | None = None, software_id: int | None = None,
               shape_key: str | None = None, backend: str | None = None,
               source_hash: str | None = None, status: str | None = None) -> list[TrialRow]:
        """Trials matching every given filter, oldest first."""
        filters = {"device_id": device_id, "software_id": software_id, "shape_key": shape_key,
                   "backend": backend, "source_hash": source_hash, "status": status}
        where = [getattr(Trial, k) == v for k, v in filters.items() if v is not None]
        with self._session() as s:
            found = self._fetch(s.scalars(select(Trial).where(*where).order_by(Trial.id)),
                                "trials")
        rows = []
        for t in found:
            try:
                rows.append(_trial_row(t))
            except RowError as e:
                self._skip(f"trial {t.id} ({str(t.shape_key)[:80]})", e)
        return rows

    @_writes
    def delete_trials(self, group: TrialGroup, statuses: Collection[str]) -> int:
        """Delete the group's trials with these statuses (never 'ok': winners name those),
        so the next sweep of the group measures those configs again."""
        bad = set(statuses) - set(TRIAL_STATUSES)
        if bad or "ok" in statuses:
            raise ValueError(f"only failed, timeout or wrong trials can be deleted, got "
                             f"{sorted(statuses)}")
        if not statuses:
            return 0
        with self._session() as s:
            return s.execute(delete(Trial).where(*group.where(Trial),
                                                 Trial.status.in_(list(statuses)))).rowcount

    @_reads
    def sources(self) -> list[SourceRow]:
        """Every (backend, kernel source) with trials, by backend, oldest source first."""
        named = _named_by_a_winner()
        with self._session() as s:
            rows = s.execute(
                select(Trial.backend, Trial.source_hash, func.count(), func.max(Trial.id),
                       func.count().filter(named))
                .group_by(Trial.backend, Trial.source_hash)
                .order_by(Trial.backend, func.max(Trial.id))).all()
        return [SourceRow(b, h, int(n), int(i), int(w)) for b, h, n, i, w in rows]

    @_writes
    def delete_sources(self, sources: Collection[tuple[str, str]]) -> DeletedRows:
        """Delete the trials and queued claims of these (backend, source hash) pairs, in one
        transaction. A trial a stored winner points at is kept (with its winner), so
        `winners()` and reports of other stacks stay whole."""
        trials = claims = kept = 0
        if not sources:
            return DeletedRows(0, 0, 0)
        named = _named_by_a_winner()
        with self._session() as s:
            for backend, source in sources:
                mine = [Trial.backend == backend, Trial.source_hash == source]
                kept += s.scalar(select(func.count()).select_from(Trial)
                                 .where(*mine, named)) or 0
                trials += s.execute(delete(Trial).where(*mine, ~named)).rowcount
                claims += s.execute(delete(Claim).where(
                    Claim.backend == backend, Claim.source_hash == source)).rowcount
        return DeletedRows(trials, claims, kept)

    @_writes
    def rename_source(self, backend: str, old: str, new: str) -> RenamedRows:
        """Re-key the trials, queued claims and winners of (backend, `old`) to `new`, in one
        transaction: results of unchanged kernel code that a new hashing scheme names
        differently. A trial or claim whose key `new` already has stays under `old` (a
        prune deletes it later), and so does a winner that points at such a trial."""
        with self._session() as s:
            trials = _rekey(s, Trial, backend, old, new)
            claims = _rekey(s, Claim, backend, old, new)
            left = s.scalar(select(func.count()).select_from(Trial).where(
                Trial.backend == backend, Trial.source_hash == old)) or 0
            renamed = exists().where(Trial.id == Winner.trial_id, Trial.source_hash == new)
            winners = s.execute(update(Winner).where(
                Winner.backend == backend, Winner.source_hash == old, renamed)
                .values(source_hash=new)).rowcount
        return RenamedRows(trials, winners, claims, left)

    @_writes
    def compact(self) -> None:
        """Give the space of deleted rows back to the file system: SQLite keeps freed pages
        in the file until VACUUM (PostgreSQL's autovacuum reuses them on its own)."""
        if self._dialect != "sqlite":
            return
        try:
            raw = self._engine.raw_connection()
            try:
                raw.driver_connection.execute("VACUUM")
            finally:
                raw.close()
        except (DBAPIError, sqlite3.Error) as e:
            failure = db_failure(e, self.url)
            if failure is None:
                raise
            raise failure from e

    @_writes
    def update_winner(self, device_id: int, software_id: int, shape_key: str,
                      current_sources: Mapping[str, str]) -> WinnerRow | None:
        """Recompute the winner of a shape from its 'ok' trials and store it atomically.

        `current_sources` maps every backend that may win to its current source hash;
        trials of other backends or of stale sources are ignored. When none qualifies the
        stored winner is removed (it would point at sources that no longer exist) and None
        is returned. Ties go to the earlier trial.
        """
        where_key = [Winner.device_id == device_id, Winner.software_id == software_id,
                     Winner.shape_key == shape_key]
        with self._session() as s:
            if self._dialect == "postgresql":  # SQLite's BEGIN IMMEDIATE already serializes
                s.execute(text("SELECT pg_advisory_xact_lock(:k)"),
                          {"k": _lock_key("winner", device_id, software_id, shape_key)})
            best = None
            if current_sources:
                current: ColumnElement[bool] = or_(*(
                    and_(Trial.backend == b, Trial.source_hash == h)
                    for b, h in current_sources.items()))
                best = s.scalars(
                    select(Trial)
                    .where(Trial.device_id == device_id, Trial.software_id == software_id,
                           Trial.shape_key == shape_key, Trial.status == "ok",
                           Trial.median_us.is_not(None), current)
                    .order_by(Trial.median_us, Trial.id).limit(1)
                ).first()
            if best is None:
                s.execute(delete(Winner).where(*where_key))
                return None
            values = {"shape_json": best.shape_json, "kv_format": best.kv_format,
                      "backend": best.backend, "source_hash": best.source_hash,
                      "config_json": best.config_json, "trial_id": best.id,
                      "median_us": best.median_us, "updated_at": utcnow()}
            s.execute(self._insert(Winner)
                      .values(device_id=device_id, software_id=software_id,
                              shape_key=shape_key, **values)
                      .on_conflict_do_update(index_elements=list(_WINNER_KEY), set_=values))
            return self._winners(s, where_key)[0]

    @_reads
    def winners(self, device_hash: str | None = None, software_hash: str | None = None,
                shape_key: str | None = None) -> list[WinnerRow]:
        """Stored winners, optionally for one device, stack and/or shape."""
        where: list[ColumnElement[bool]] = []
        if device_hash is not None:
            where.append(Device.hash == device_hash)
        if software_hash is not None:
            where.append(Software.hash == software_hash)
        if shape_key is not None:
            where.append(Winner.shape_key == shape_key)
        with self._session() as s:
            return self._winners(s, where, self._skip)

    def _winners(self, s: Session, where: list[ColumnElement[bool]],
                 skip: Callable[[str, RowError], None] | None = None) -> list[WinnerRow]:
        """Winners matching `where`; an undecodable one is passed to `skip` (raised when
        there is none)."""
        rows = self._fetch(s.execute(
            select(Winner, Device, Software)
            .join(Device, Winner.device_id == Device.id)
            .join(Software, Winner.software_id == Software.id)
            .where(*where)
            .order_by(Winner.device_id, Winner.software_id, Winner.shape_key)
        ), "winners")
        out = []
        for w, d, sw in rows:
            try:
                out.append(_winner_row(w, d, sw))
            except RowError as e:
                if skip is None:
                    raise
                skip(f"winner {w.id} ({str(w.shape_key)[:80]})", e)
        return out

    def _fetch(self, result: Any, table: str) -> list[Any]:
        """All rows of `result`. A value SQLAlchemy cannot convert (a date that is no date)
        fails the whole query: a DBError naming the table, not a traceback."""
        try:
            return list(result.all())
        except (ValueError, TypeError, OverflowError) as e:
            raise DBError(f"the tuning DB {self.url} holds a row of its {table} that cannot "
                          f"be read ({str(e)[:200]}); it is damaged or was written by "
                          "something else: restore a backup, or delete that row") from None

    @property
    def skipped(self) -> list[str]:
        """Rows the reads so far skipped, each with why: damaged or foreign rows that no
        report or dispatcher can use (also logged as warnings)."""
        return list(self.__dict__.get("_skipped", ()))

    def _skip(self, what: str, error: RowError) -> None:
        skipped = self.__dict__.setdefault("_skipped", {})
        message = f"{what}: {error}"
        if message not in skipped:
            skipped[message] = None
            log.warning("mla-tune: skipping %s in %s", message, self.url)

    @_writes
    def optuna_storage(self, heartbeat_s: int | None = None,
                       grace_s: int | None = None) -> RDBStorage:
        """An Optuna storage on this same database, so studies live next to the trials.

        With `heartbeat_s`, trials a process asked for can be heartbeated, and those of a
        process that died are failed after `grace_s` by `optuna.storages.fail_stale_trials`
        instead of staying RUNNING forever (which would mislead TPE's constant liar)."""
        import optuna

        for attempt in range(1, _OPTUNA_OPEN_ATTEMPTS):
            try:
                return self._open_optuna(heartbeat_s, grace_s)
            except (DBAPIError, optuna.exceptions.StorageInternalError):
                time.sleep(0.2 * attempt)
        return self._open_optuna(heartbeat_s, grace_s)

    def _open_optuna(self, heartbeat_s: int | None, grace_s: int | None) -> RDBStorage:
        import optuna

        kwargs: dict[str, Any] = ({"connect_args": {"timeout": BUSY_TIMEOUT_S}}
                                  if self._dialect == "sqlite" else {"pool_pre_ping": True})
        with warnings.catch_warnings():  # heartbeat_interval is "experimental"
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                self._url.render_as_string(hide_password=False), engine_kwargs=kwargs,
                heartbeat_interval=heartbeat_s, grace_period=grace_s)
