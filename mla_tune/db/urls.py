"""Where the tuning DB is: a URL, a bare path (a SQLite file), $MLA_TUNE_DB, the default
./tuning.db, or `shipped` (the results shipped with mla-tune, read-only)."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import URL, make_url
from sqlalchemy.exc import ArgumentError

from mla_tune.db.rows import DBError

ENV_VAR = "MLA_TUNE_DB"
DEFAULT_URL = "sqlite:///tuning.db"
# `--db shipped`: the tuning results shipped with mla-tune, read-only (see shipped_db_url).
SHIPPED = "shipped"


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


def raw_url(url: str | None) -> str:
    """The DB asked for, unparsed: `url`, else $MLA_TUNE_DB, else the default."""
    return url or os.environ.get(ENV_VAR) or DEFAULT_URL


def resolve_url(url: str | None = None) -> URL:
    """`url`, else $MLA_TUNE_DB, else ./tuning.db; a bare path means a SQLite file, and
    `shipped` the results shipped with mla-tune (`./shipped` is a file of that name)."""
    raw = raw_url(url)
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


def sqlite_file_size(url: str) -> int | None:
    """Size in bytes of the file of a SQLite URL; None for a server DB or no file."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database:
        return None
    path = Path(u.database)
    return path.stat().st_size if path.is_file() else None
