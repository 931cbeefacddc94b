"""Maintenance on SQLAlchemy: listing, deleting and renaming the results of kernel sources,
and giving freed space back (see `BaseTuningStore`'s "Maintenance")."""

from __future__ import annotations

import sqlite3
from collections.abc import Collection

from sqlalchemy import ColumnElement, delete, exists, func, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, aliased

from mla_tune.db.engine import SQLEngine, reads, writes
from mla_tune.db.failures import db_failure
from mla_tune.db.models import Claim, Trial, Winner
from mla_tune.db.rows import DeletedRows, RenamedRows, SourceRow


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


class SQLMaintenance(SQLEngine):
    """`BaseTuningStore`'s maintenance, over every table of ours."""

    @reads
    def sources(self) -> list[SourceRow]:
        named = _named_by_a_winner()
        with self._session() as s:
            rows = s.execute(
                select(Trial.backend, Trial.source_hash, func.count(), func.max(Trial.id),
                       func.count().filter(named))
                .group_by(Trial.backend, Trial.source_hash)
                .order_by(Trial.backend, func.max(Trial.id))).all()
        return [SourceRow(b, h, int(n), int(i), int(w)) for b, h, n, i, w in rows]

    @writes
    def delete_sources(self, sources: Collection[tuple[str, str]]) -> DeletedRows:
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

    @writes
    def rename_source(self, backend: str, old: str, new: str) -> RenamedRows:
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

    @writes
    def compact(self) -> None:
        """SQLite keeps freed pages in the file until VACUUM, and under WAL the file shrinks
        only when the log is checkpointed into it, so both run here (the checkpoint does
        what readers allow). PostgreSQL's autovacuum reuses freed space on its own, so
        there this does nothing."""
        if self._dialect != "sqlite":
            return
        try:
            raw = self._engine.raw_connection()
            try:
                raw.driver_connection.execute("VACUUM")
                raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                raw.close()
        except (DBAPIError, sqlite3.Error) as e:
            failure = db_failure(e, self.url)
            if failure is None:
                raise
            raise failure from e
