"""Results on SQLAlchemy: devices and stacks, trials, and the winner of each shape (see
`BaseTuningStore`'s "Results"). Which trial wins is not decided here
(`mla_tune.results.selection` is the policy); this module stores its choice atomically."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, or_, select, update
from sqlalchemy.orm import Session

from mla_tune.db.decode import RowError, aware, trial_row, winner_row
from mla_tune.db.engine import GROUP_KEY, TRIAL_KEY, SQLEngine, group_where, reads, writes
from mla_tune.db.models import TRIAL_STATUSES, Claim, Device, Software, Trial, Winner, utcnow
from mla_tune.db.rows import (
    STAT_KEYS,
    DBError,
    DeviceRow,
    TrialGroup,
    TrialResult,
    TrialRow,
)
from mla_tune.machine.fingerprint import DeviceFingerprint, SoftwareFingerprint
from mla_tune.results import winner as record
from mla_tune.tuning.space import config_key

_WINNER_KEY = ("device_id", "software_id", "shape_key")


class SQLResults(SQLEngine):
    """`BaseTuningStore`'s results, in the `mt_devices`, `mt_software`, `mt_trials` and
    `mt_winners` tables."""

    # Lists and logs a row a read skipped (`TuningStore._skip`, on the store's logger).
    _skip: Callable[[str, RowError], None]

    @writes
    def device_id(self, fp: DeviceFingerprint) -> int:
        with self._session() as s:
            s.execute(self._insert(Device).values(
                hash=fp.hash, vendor=fp.vendor, name=fp.name, arch=fp.arch,
                sm_count=fp.sm_count, memory_bytes=fp.memory_bytes, created_at=utcnow(),
            ).on_conflict_do_nothing(index_elements=["hash"]))
            return s.execute(select(Device.id).where(Device.hash == fp.hash)).scalar_one()

    @writes
    def software_id(self, fp: SoftwareFingerprint) -> int:
        with self._session() as s:
            s.execute(self._insert(Software).values(
                hash=fp.hash, versions_json=config_key(fp.to_json()),
            ).on_conflict_do_nothing(index_elements=["hash"]))
            return s.execute(select(Software.id).where(Software.hash == fp.hash)).scalar_one()

    @reads
    def devices(self) -> list[DeviceRow]:
        with self._session() as s:
            return [DeviceRow(id=d.id, hash=d.hash,
                              fingerprint=DeviceFingerprint(d.vendor, d.name, d.arch,
                                                            d.sm_count, d.memory_bytes),
                              read_bw_gbps=d.read_bw_gbps, created_at=aware(d.created_at))
                    for d in s.scalars(select(Device).order_by(Device.id))]

    @writes
    def set_read_bandwidth(self, device_id: int, gbps: float) -> None:
        if not (math.isfinite(gbps) and gbps > 0):
            raise ValueError(f"read bandwidth must be a positive number of GB/s, got {gbps}")
        with self._session() as s:
            result = s.execute(update(Device).where(Device.id == device_id)
                               .values(read_bw_gbps=float(gbps)))
            if result.rowcount == 0:
                raise KeyError(f"no device with id {device_id}")

    @writes
    def record_trial(self, group: TrialGroup, result: TrialResult) -> int:
        ckey = config_key(result.config)  # the config's canonical JSON, stored as both
        key = {**{k: getattr(group, k) for k in GROUP_KEY}, "config_key": ckey}
        stats = result.stats or {}
        with self._session() as s:
            self._lock_group(s, group, shared=True)
            s.execute(self._insert(Trial).values(
                **key, shape_json=config_key(result.shape_json), kv_format=result.kv_format,
                config_json=ckey, status=result.status, **{k: stats.get(k) for k in STAT_KEYS},
                max_abs_err=result.max_abs_err, mismatch_frac=result.mismatch_frac,
                error=result.error, worker=result.worker, created_at=utcnow(),
            ).on_conflict_do_nothing(index_elements=list(TRIAL_KEY)))
            s.execute(delete(Claim).where(*(getattr(Claim, k) == v for k, v in key.items())))
            where = [getattr(Trial, k) == v for k, v in key.items()]
            return s.execute(select(Trial.id).where(*where)).scalar_one()

    @writes
    def record_remeasure(self, results: Mapping[int, Mapping[str, float | int]]) -> datetime:
        """Each trial keeps the better of its timings because each can be spoiled, in
        opposite ways: a first one by a slow moment of the device (finalists timed one by
        one), a re-timing by a slow moment of one variant's launches (seen on the H200 for a
        few small-shape variants)."""
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

    @writes
    def mark_wrong(self, trial_id: int, error: str, max_abs_err: float | None = None,
                   mismatch_frac: float | None = None) -> None:
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

    def measured(self, group: TrialGroup) -> dict[str, TrialRow]:
        rows = self.trials(**{k: getattr(group, k) for k in GROUP_KEY})
        return {r.config_key: r for r in rows}

    @reads
    def trials(self, *, device_id: int | None = None, software_id: int | None = None,
               shape_key: str | None = None, backend: str | None = None,
               source_hash: str | None = None, status: str | None = None) -> list[TrialRow]:
        filters = {"device_id": device_id, "software_id": software_id, "shape_key": shape_key,
                   "backend": backend, "source_hash": source_hash, "status": status}
        where = [getattr(Trial, k) == v for k, v in filters.items() if v is not None]
        with self._session() as s:
            return self._trial_rows(s, where)

    def _trial_rows(self, s: Session, where: list[ColumnElement[bool]]) -> list[TrialRow]:
        """Trials matching `where`, oldest first; undecodable ones are skipped."""
        found = self._fetch(s.scalars(select(Trial).where(*where).order_by(Trial.id)),
                            "trials")
        rows = []
        for t in found:
            try:
                rows.append(trial_row(t))
            except RowError as e:
                self._skip(f"trial {t.id} ({str(t.shape_key)[:80]})", e)
        return rows

    @writes
    def delete_trials(self, group: TrialGroup, statuses: Collection[str]) -> int:
        bad = set(statuses) - set(TRIAL_STATUSES)
        if bad or "ok" in statuses:
            raise ValueError(f"only failed, timeout or wrong trials can be deleted, got "
                             f"{sorted(statuses)}")
        if not statuses:
            return 0
        with self._session() as s:
            return s.execute(delete(Trial).where(*group_where(group, Trial),
                                                 Trial.status.in_(list(statuses)))).rowcount

    @writes
    def supersede_timings(self, group: TrialGroup) -> int:
        ok = [*group_where(group, Trial), Trial.status == "ok"]
        with self._session() as s:
            # The shape's winner lock, as replace_winner takes it: no choice races this.
            self._lock(s, "winner", group.device_id, group.software_id, group.shape_key)
            s.execute(delete(Winner).where(Winner.trial_id.in_(select(Trial.id).where(*ok))))
            return s.execute(delete(Trial).where(*ok)).rowcount

    @writes
    def replace_winner(self, device_id: int, software_id: int, shape_key: str,
                       sources: Mapping[str, str],
                       choose: Callable[[Sequence[TrialRow]], TrialRow | None],
                       ) -> record.Winner | None:
        where_key = [Winner.device_id == device_id, Winner.software_id == software_id,
                     Winner.shape_key == shape_key]
        with self._session() as s:
            self._lock(s, "winner", device_id, software_id, shape_key)
            candidates: list[TrialRow] = []
            if sources:
                current: ColumnElement[bool] = or_(*(
                    and_(Trial.backend == b, Trial.source_hash == h) for b, h in sources.items()))
                candidates = self._trial_rows(s, [
                    Trial.device_id == device_id, Trial.software_id == software_id,
                    Trial.shape_key == shape_key, current])
            best = choose(candidates)
            if best is None:
                s.execute(delete(Winner).where(*where_key))
                return None
            if all(best.id != c.id for c in candidates):
                raise ValueError(f"the chosen trial {best.id} is not one of the candidates "
                                 f"of {shape_key}; a winner is chosen among them")
            t = s.get(Trial, best.id)
            assert t is not None  # a candidate read in this transaction
            values = {"shape_json": t.shape_json, "kv_format": t.kv_format,
                      "backend": t.backend, "source_hash": t.source_hash,
                      "config_json": t.config_json, "trial_id": t.id,
                      "median_us": t.median_us, "updated_at": utcnow()}
            s.execute(self._insert(Winner)
                      .values(device_id=device_id, software_id=software_id,
                              shape_key=shape_key, **values)
                      .on_conflict_do_update(index_elements=list(_WINNER_KEY), set_=values))
            return self._winners(s, where_key)[0]

    @reads
    def winners(self, device_hash: str | None = None, software_hash: str | None = None,
                shape_key: str | None = None) -> list[record.Winner]:
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
                 skip: Callable[[str, RowError], None] | None = None) -> list[record.Winner]:
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
                out.append(winner_row(w, d, sw))
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
