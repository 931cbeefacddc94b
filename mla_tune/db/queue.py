"""The work queue on SQLAlchemy: the candidates of each trial group that every sweep on the
DB shares, claimed one at a time (see `BaseTuningStore`'s "Claims")."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from sqlalchemy import ColumnElement, exists, func, or_, select, update
from sqlalchemy.orm import Session

from mla_tune.db.engine import GROUP_KEY, TRIAL_KEY, SQLEngine, group_where, reads, writes
from mla_tune.db.models import Claim, Trial, utcnow
from mla_tune.db.rows import ClaimRow, TrialGroup
from mla_tune.tuning.space import config_key


class SQLWorkQueue(SQLEngine):
    """`BaseTuningStore`'s claims, in the `mt_claims` table."""

    def _unmeasured(self) -> ColumnElement[bool]:
        """Claims whose candidate has no trial yet."""
        return ~exists().where(*(getattr(Trial, k) == getattr(Claim, k) for k in TRIAL_KEY))

    def _spent(self, s: Session, group: TrialGroup, stale_after_s: float,
               dead_owners: Collection[str]) -> int:
        """Configs of `group` measured or being measured by a live holder, by any sweep."""
        live = [Claim.state == "running", Claim.heartbeat_at >= self._db_now() - stale_after_s,
                self._unmeasured()]
        if dead_owners:
            live.append(Claim.claimed_by.not_in(sorted(dead_owners)))
        trials = s.scalar(select(func.count()).select_from(Trial)
                          .where(*group_where(group, Trial)))
        held = s.scalar(select(func.count()).select_from(Claim)
                        .where(*group_where(group, Claim), *live))
        return int(trials or 0) + int(held or 0)

    @reads
    def spent(self, group: TrialGroup, *, stale_after_s: float,
              dead_owners: Collection[str] = ()) -> int:
        with self._session() as s:
            return self._spent(s, group, stale_after_s, dead_owners)

    @writes
    def enqueue(self, group: TrialGroup, configs: Iterable[Mapping[str, Any]]) -> None:
        keys = dict.fromkeys(config_key(c) for c in configs)  # canonical JSON, in order
        with self._session() as s:
            self._lock_group(s, group)
            measured = set(s.scalars(select(Trial.config_key)
                                     .where(*group_where(group, Trial))))
            values = [{**{k: getattr(group, k) for k in GROUP_KEY}, "config_key": c,
                       "config_json": c, "state": "pending", "created_at": utcnow()}
                      for c in keys if c not in measured]
            if values:
                s.execute(self._insert(Claim)
                          .on_conflict_do_nothing(index_elements=list(TRIAL_KEY)), values)

    @writes
    def claim(self, group: TrialGroup, owner: str, *, stale_after_s: float,
              dead_owners: Collection[str] = (), config: Mapping[str, Any] | None = None,
              budget: int | None = None) -> dict[str, Any] | None:
        """PostgreSQL locks the row with FOR UPDATE SKIP LOCKED, so concurrent claimers take
        different rows without waiting (claims that queue a config or count a budget take
        the group's lock first); SQLite's BEGIN IMMEDIATE serializes claimers."""
        now = self._db_now()
        claimable = [Claim.state == "pending", Claim.heartbeat_at < now - stale_after_s]
        if dead_owners:
            claimable.append(Claim.claimed_by.in_(sorted(dead_owners)))
        query = (select(Claim.id, Claim.config_json)
                 .where(*group_where(group, Claim), or_(*claimable), self._unmeasured())
                 .order_by(Claim.id).limit(1).with_for_update(skip_locked=True, of=Claim))
        with self._session() as s:
            if config is not None or budget is not None:
                self._lock_group(s, group)
            if budget is not None and self._spent(s, group, stale_after_s,
                                                  dead_owners) >= budget:
                return None
            if config is not None:
                key = config_key(config)
                if s.scalar(select(exists().where(*group_where(group, Trial),
                                                  Trial.config_key == key))):
                    return None
                s.execute(self._insert(Claim).values(
                    **{k: getattr(group, k) for k in GROUP_KEY}, config_key=key,
                    config_json=key, state="pending", created_at=utcnow(),
                ).on_conflict_do_nothing(index_elements=list(TRIAL_KEY)))
                query = query.where(Claim.config_key == key)
            row = s.execute(query).first()
            if row is None:
                return None
            s.execute(update(Claim).where(Claim.id == row.id)
                      .values(state="running", claimed_by=owner, heartbeat_at=now))
            return json.loads(row.config_json)

    @writes
    def heartbeat(self, owner: str) -> int:
        with self._session() as s:
            result = s.execute(update(Claim)
                               .where(Claim.claimed_by == owner, Claim.state == "running")
                               .values(heartbeat_at=self._db_now()))
            return result.rowcount or 0

    @writes
    def release(self, owner: str) -> int:
        with self._session() as s:
            result = s.execute(update(Claim)
                               .where(Claim.claimed_by == owner, Claim.state == "running")
                               .values(state="pending", claimed_by=None, heartbeat_at=None))
            return result.rowcount or 0

    @reads
    def claims(self, group: TrialGroup) -> list[ClaimRow]:
        age = (self._db_now() - Claim.heartbeat_at).label("age")
        with self._session() as s:
            rows = s.execute(select(Claim, age)
                             .where(*group_where(group, Claim), self._unmeasured())
                             .order_by(Claim.id)).all()
            return [ClaimRow(config=json.loads(c.config_json), config_key=c.config_key,
                             state=c.state, claimed_by=c.claimed_by, heartbeat_age_s=a)
                    for c, a in rows]
