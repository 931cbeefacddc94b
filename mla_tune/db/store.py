"""The tuning store on SQLAlchemy URLs: SQLite files and PostgreSQL databases.

`TuningStore` implements `BaseTuningStore` from one module per concern: opening and
migrating (`engine`), the work queue (`queue`), trials and winners (`results`), and
maintenance (`maintenance`). Optuna's tables share the database under their own names
(ours start with `mt_`), opened through `mla_tune.tuning.optuna_study`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mla_tune.db.decode import RowError
from mla_tune.db.engine import BUSY_TIMEOUT_S, writes
from mla_tune.db.maintenance import SQLMaintenance
from mla_tune.db.queue import SQLWorkQueue
from mla_tune.db.results import SQLResults

if TYPE_CHECKING:
    from optuna.storages import RDBStorage

log = logging.getLogger(__name__)


class TuningStore(SQLWorkQueue, SQLResults, SQLMaintenance):
    """Tuning results in SQLite or PostgreSQL; the schema is migrated to head on open.

    With `read_only=True` (reports, diff, export, the dispatcher) the DB is only read: it
    must exist and be at this mla-tune's schema revision (no migration runs), a SQLite file
    is opened with `mode=ro` (no WAL switch, no write lock, nothing created), PostgreSQL
    transactions are READ ONLY, and every write method raises DBError. A SQLite file that
    no process has open (no -wal file next to it) is read without locks or -wal/-shm files
    (`immutable=1`, retried through WAL's shared memory if the file changes meanwhile), so
    a DB in a read-only directory can be read and no read leaves files behind.

    Writers on SQLite take the write lock when their transaction begins (BEGIN IMMEDIATE),
    which serializes them; on PostgreSQL, claims lock their row (FOR UPDATE SKIP LOCKED)
    and the steps that must not interleave take advisory locks."""

    @property
    def skipped(self) -> list[str]:
        return list(self.__dict__.get("_skipped", ()))

    def _skip(self, what: str, error: RowError) -> None:
        skipped = self.__dict__.setdefault("_skipped", {})
        message = f"{what}: {error}"
        if message not in skipped:
            skipped[message] = None
            log.warning("mla-tune: skipping %s in %s", message, self.url)

    @writes
    def optuna_storage(self, heartbeat_s: int | None = None,
                       grace_s: int | None = None) -> RDBStorage:
        from mla_tune.tuning.optuna_study import open_storage

        engine_kwargs = ({"connect_args": {"timeout": BUSY_TIMEOUT_S}}
                         if self._dialect == "sqlite" else {"pool_pre_ping": True})
        return open_storage(self._url.render_as_string(hide_password=False), engine_kwargs,
                            heartbeat_s=heartbeat_s, grace_s=grace_s)
