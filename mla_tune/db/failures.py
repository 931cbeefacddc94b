"""What to tell the user when the DB's storage, not a statement, fails: a full disk, a
damaged file, an I/O error, a read-only file or server. Both databases roll the failed
transaction back, so every message can say that nothing stored was lost."""

from __future__ import annotations

import sqlite3

from mla_tune.db.rows import DBError

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
