"""The SQLAlchemy side of the tuning store that every concern shares: opening SQLite and
PostgreSQL safely (file checks, WAL, busy timeouts, read-only and lock-free reads),
migrating the schema one process at a time, and one-transaction sessions.

`SQLEngine` is the base of the store's concern modules (`queue`, `results`,
`maintenance`); `TuningStore` (`store`) puts them together.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Float,
    cast,
    create_engine,
    event,
    extract,
    func,
    inspect,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from mla_tune.db.base import BaseTuningStore
from mla_tune.db.failures import db_failure
from mla_tune.db.models import VERSION_TABLE, Claim, Trial
from mla_tune.db.rows import DBError, TrialGroup
from mla_tune.db.urls import SHIPPED, raw_url, resolve_url, shipped_db_path

SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 30
# A read-only opener never waits on a writer under WAL; this only bounds odd cases (a DB
# left in rollback-journal mode, WAL recovery) so a serving process is never held for long.
READ_ONLY_BUSY_TIMEOUT_S = 5
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
GROUP_KEY = ("device_id", "software_id", "shape_key", "backend", "source_hash")
# A trial's and a claim's unique key: its group and config.
TRIAL_KEY = (*GROUP_KEY, "config_key")


class _ChangedWhileReading(Exception):
    """A read of a cleanly closed SQLite file (opened immutable) saw the file change."""


_F = TypeVar("_F", bound=Callable[..., Any])


def writes(method: _F) -> _F:
    """Refuse `method` on a read-only store, before touching the DB."""
    @functools.wraps(method)
    def wrapper(self: SQLEngine, *args: Any, **kwargs: Any) -> Any:
        if self.read_only:
            raise DBError(f"cannot {method.__name__}: the tuning DB {self.url} was opened "
                          "read-only; open it with TuningStore(url) (read_only=False) to "
                          "write")
        return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def reads(method: _F) -> _F:
    """Run `method` again when a lock-free read saw the file change under it."""
    @functools.wraps(method)
    def wrapper(self: SQLEngine, *args: Any, **kwargs: Any) -> Any:
        for _ in range(3):
            try:
                return method(self, *args, **kwargs)
            except _ChangedWhileReading:
                continue
        self._lock_free = False  # a writer is busy: read through WAL's shared memory
        return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def group_where(group: TrialGroup, model: type[Trial] | type[Claim]) -> list[ColumnElement[bool]]:
    """The WHERE clauses that select `group`'s rows of `model`."""
    return [getattr(model, k) == getattr(group, k) for k in GROUP_KEY]


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


def clean_state(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of a SQLite file no connection has open (no -wal file next to
    it), else None."""
    if Path(f"{path}-wal").exists():
        return None
    st = path.stat()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def lock_key(*parts: object) -> int:
    """A signed 64-bit PostgreSQL advisory lock id for `parts`."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class SQLEngine(BaseTuningStore):
    """A tuning DB at a SQLAlchemy URL (SQLite or PostgreSQL), open and at schema head;
    see `TuningStore` for what read-only mode does here."""

    def __init__(self, url: str | None = None, *, read_only: bool = False) -> None:
        if not read_only and raw_url(url) == SHIPPED:
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
        state = clean_state(self._ro_path) if self._lock_free else None
        uri = f"file:{quote(str(self._ro_path))}?mode=ro" + ("&immutable=1" if state else "")
        conn = sqlite3.connect(uri, uri=True, timeout=READ_ONLY_BUSY_TIMEOUT_S,
                               check_same_thread=False, factory=_ReadOnlyConnection)
        conn.clean_state = state
        return conn

    @reads
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
                                 {"k": lock_key("mla-tune migrations")})
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
                # A lock-free read (see `TuningStore`) must not have seen a change.
                dbapi = session.connection().connection.dbapi_connection
                state = getattr(dbapi, "clean_state", None)
                try:
                    yield session
                except DBAPIError:
                    if state is not None and clean_state(self._ro_path) != state:
                        raise _ChangedWhileReading from None
                    raise
                if state is not None and clean_state(self._ro_path) != state:
                    raise _ChangedWhileReading
        except DBAPIError as e:
            failure = None if self.read_only else db_failure(e, self.url)
            if failure is None:
                raise
            raise failure from e

    def _insert(self, model: type[Any]) -> Any:
        """An INSERT of this dialect (both support ON CONFLICT DO NOTHING / UPDATE)."""
        dialect = sqlite if self._dialect == "sqlite" else postgresql
        return dialect.insert(model)

    def _db_now(self) -> ColumnElement[float]:
        """Seconds since the epoch by the database's clock: heartbeats written from several
        machines are compared on one clock."""
        if self._dialect == "postgresql":
            return cast(extract("epoch", func.now()), Float)
        return (func.julianday("now") - 2440587.5) * 86400.0

    def _lock(self, s: Session, *parts: object, shared: bool = False) -> None:
        """PostgreSQL: take the transaction-scoped advisory lock named by `parts` (shared or
        exclusive). SQLite's BEGIN IMMEDIATE already serializes every writer."""
        if self._dialect != "postgresql":
            return
        fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        s.execute(text(f"SELECT {fn}(:k)"), {"k": lock_key(*parts)})

    def _lock_group(self, s: Session, group: TrialGroup, *, shared: bool = False) -> None:
        """PostgreSQL: order queueing a candidate of `group` (exclusive) against storing a
        trial of it (shared), so no claim is queued for a trial stored in the meantime."""
        self._lock(s, "claims", *(getattr(group, k) for k in GROUP_KEY), shared=shared)
