"""Real SQLite faults for tests: a full disk (SQLITE_FULL from the page limit SQLite enforces
on a connection) and damaged files (truncated, pages overwritten)."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.pool import Pool

PAGE = 4096


@contextmanager
def disk_full_after(pages: int) -> Iterator[None]:
    """Every SQLite connection opened meanwhile in this process may grow its database by
    `pages` pages at most; the next write that needs more fails as on a full disk
    (SQLITE_FULL, "database or disk is full")."""
    def limit(dbapi_conn: Any, _record: Any) -> None:
        if isinstance(dbapi_conn, sqlite3.Connection):
            (count,) = dbapi_conn.execute("PRAGMA page_count").fetchone()
            dbapi_conn.execute(f"PRAGMA max_page_count = {count + pages}")

    event.listen(Pool, "connect", limit)
    try:
        yield
    finally:
        event.remove(Pool, "connect", limit)


def truncate(path: Path) -> None:
    """Cut the file in the middle of a page, past its first pages."""
    size = path.stat().st_size
    assert size > 8 * PAGE, "the DB is too small to damage meaningfully"
    with path.open("r+b") as f:
        f.truncate(size // 2 + PAGE // 3)


def overwrite_pages(path: Path, first: int, count: int = 3, seed: int = 0) -> None:
    """Overwrite `count` pages from page `first` (1-based) with random bytes."""
    rng = random.Random(seed)
    with path.open("r+b") as f:
        f.seek((first - 1) * PAGE)
        f.write(rng.randbytes(count * PAGE))


def overwrite_header(path: Path, seed: int = 0) -> None:
    """Keep SQLite's 16-byte magic and overwrite the rest of the file header."""
    rng = random.Random(seed)
    with path.open("r+b") as f:
        f.seek(16)
        f.write(rng.randbytes(84))


def fill(path: Path, trials: int = 60) -> None:
    """A real tuning DB of a few dozen pages at `path`, closed cleanly (no -wal file)."""
    from mla_tune.db import TrialGroup, TrialResult, TuningStore
    from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

    with TuningStore(str(path)) as store:
        group = TrialGroup(store.device_id(GPU), store.software_id(STACK), SHAPE_KEY,
                           "triton", "5c0a")
        for i in range(trials):
            store.record_trial(group, TrialResult(SHAPE, "bf16", {"i": i, "pad": "x" * 2000},
                                                  "ok", {"median_us": 10.0 + i}))


def integrity(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [r[0] for r in conn.execute("PRAGMA integrity_check")]
