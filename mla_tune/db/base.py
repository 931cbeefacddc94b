"""The storage contract of the tuning DB: what every store promises, whatever holds the data.

`TuningStore` (SQLite and PostgreSQL through SQLAlchemy) is the implementation;
tests/db/test_storage_contract.py checks these promises against both databases.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Self

from mla_tune.db.rows import (
    ClaimRow,
    DeletedRows,
    DeviceRow,
    RenamedRows,
    SourceRow,
    TrialGroup,
    TrialResult,
    TrialRow,
)
from mla_tune.machine.fingerprint import DeviceFingerprint, SoftwareFingerprint
from mla_tune.results.winner import Winner

if TYPE_CHECKING:
    from optuna.storages import BaseStorage


class BaseTuningStore(abc.ABC):
    """Trials, winners and the shared work queue of tuning processes.

    **Sharing.** One store (a SQLite file, a PostgreSQL database) is shared by every sweep
    on it, on one machine or many, and by Optuna's studies (`optuna_storage`). Processes
    coordinate through the store alone; a store object is used by one thread at a time.

    **Records.** Everything handed back is frozen plain data (`mla_tune.db.rows`), never
    tied to a connection. Configs and shapes are JSON objects the store does not interpret;
    a config is identified by its canonical JSON (`mla_tune.space.config_key`).

    **Atomicity.** Each write method is one transaction: it happens wholly or not at all,
    also when the process is killed or the storage fails midway. In particular
    `record_trial` stores a trial and drops its claim together; `claim` picks a candidate
    and marks it taken together; `replace_winner` reads a shape's candidates, lets the
    caller choose, and stores the choice as one step that is serialized per (device,
    stack, shape); `record_remeasure`, `delete_sources` and `rename_source` change all
    their rows or none. Get-or-create (`device_id`, `software_id`) and storing a trial
    twice are safe under concurrency: the first stored trial of a key is kept.

    **Claims.** A candidate of a `TrialGroup` is queued (pending), claimed (running, by
    one owner) or measured (its trial is stored), never two of these. An owner is an opaque
    string naming one process; it keeps its claims alive with `heartbeat`, which stamps
    them with the database's clock (so machines with skewed clocks agree), and hands them
    back with `release` when it stops cleanly. A claim is stale when its owner has not
    heartbeated for the claimer's `stale_after_s`, or the claimer names its owner in
    `dead_owners` (a process known to have died): `claim` then hands it to the claimer,
    who owns it from then on. The former owner is not told; should it still store the
    trial, the first trial stored is kept and the claim is dropped whoever holds it, so a
    candidate is stored once.

    **Read-only.** A store opened read-only never creates, migrates, locks or writes the
    database (a SQLite file's bytes stay as they are and no -wal/-shm file appears); it
    refuses a database that is missing or not at this mla-tune's schema, and every write
    method (`optuna_storage` included) raises DBError before touching the database.

    **Damage.** Reads skip a row that cannot be decoded, list it in `skipped` and log it,
    instead of failing on the whole table.

    **Errors.** DBError: the database cannot be used as given, or its storage failed (disk
    full, damaged file, read-only server); the message says what to do, and nothing stored
    before is lost. ValueError: an argument no row can hold. Other exceptions are bugs or
    documented per method.
    """

    read_only: bool

    # Connection

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the store is, with any password masked: for messages and reports."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and file handles; the store is not used afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def optuna_storage(self, heartbeat_s: int | None = None,
                       grace_s: int | None = None) -> BaseStorage:
        """An Optuna storage in the same database, so studies live next to the trials.

        With `heartbeat_s`, the trials a process asked for can be heartbeated, and those of
        a process that died are failed after `grace_s` instead of staying RUNNING. Refused
        read-only: Optuna may create its tables."""

    # Devices and software stacks

    @abc.abstractmethod
    def device_id(self, fp: DeviceFingerprint) -> int:
        """The id of `fp`'s device row, created on first sight."""

    @abc.abstractmethod
    def software_id(self, fp: SoftwareFingerprint) -> int:
        """The id of `fp`'s software-stack row, created on first sight."""

    @abc.abstractmethod
    def devices(self) -> list[DeviceRow]:
        """Every device, oldest first."""

    @abc.abstractmethod
    def set_read_bandwidth(self, device_id: int, gbps: float) -> None:
        """Store a device's measured streaming-read bandwidth (the roofline of reports).
        Raises ValueError unless `gbps` is positive and finite, KeyError for an unknown
        device."""

    # Claims: the work queue

    @abc.abstractmethod
    def enqueue(self, group: TrialGroup, configs: Iterable[Mapping[str, Any]]) -> None:
        """Queue candidates of `group`, in order; measured or already queued ones are left
        as they are."""

    @abc.abstractmethod
    def claim(self, group: TrialGroup, owner: str, *, stale_after_s: float,
              dead_owners: Collection[str] = (), config: Mapping[str, Any] | None = None,
              budget: int | None = None) -> dict[str, Any] | None:
        """Take one unmeasured candidate of `group` for `owner`: the oldest queued one or a
        stale claim (see "Claims"). With `config`, that config is queued unless it is
        measured, and only it may be taken. With `budget`, nothing is taken once `spent`
        reaches it, so concurrent sweeps together measure at most `budget` configs of the
        group. Returns the config, or None when nothing can be taken."""

    @abc.abstractmethod
    def heartbeat(self, owner: str) -> int:
        """Mark `owner`'s claims alive; returns how many it holds."""

    @abc.abstractmethod
    def release(self, owner: str) -> int:
        """Queue `owner`'s claims again (a clean stop), so the next claimer takes them at
        once instead of waiting for them to go stale; returns how many."""

    @abc.abstractmethod
    def claims(self, group: TrialGroup) -> list[ClaimRow]:
        """The queued and claimed candidates of `group` not yet measured, oldest first."""

    @abc.abstractmethod
    def spent(self, group: TrialGroup, *, stale_after_s: float,
              dead_owners: Collection[str] = ()) -> int:
        """What counts against a budget of `group`, whichever sweep spent it: its stored
        trials plus its candidates claimed by owners that are alive (heartbeat within
        `stale_after_s`, not in `dead_owners`)."""

    # Results: trials and winners

    @abc.abstractmethod
    def record_trial(self, group: TrialGroup, result: TrialResult) -> int:
        """Store the trial of one config of `group` and drop its claim; returns its id. A
        trial already stored for the key is kept as it is and its id returned, so a rerun
        or two owners racing on one config never store two. Ids that name no device or
        stack are the database's integrity error."""

    @abc.abstractmethod
    def record_remeasure(self, results: Mapping[int, Mapping[str, float | int]]) -> datetime:
        """Store the side-by-side re-timing of a shape's finalists, {trial id: stats}: each
        trial keeps the statistics of its better timing (lower median), its first median in
        `first_median_us`, this one's in `runoff_median_us`, and the `remeasured_at` they
        share, which is returned. Raises ValueError (storing nothing) unless every stats
        has every STAT_KEYS with a finite median and every id is an 'ok' trial."""

    @abc.abstractmethod
    def mark_wrong(self, trial_id: int, error: str, max_abs_err: float | None = None,
                   mismatch_frac: float | None = None) -> None:
        """Make an 'ok' trial 'wrong' (its variant failed the check when built again), so it
        never wins; its median is kept in `first_median_us`. Raises ValueError for a trial
        that is not a stored 'ok' one."""

    @abc.abstractmethod
    def trials(self, *, device_id: int | None = None, software_id: int | None = None,
               shape_key: str | None = None, backend: str | None = None,
               source_hash: str | None = None, status: str | None = None) -> list[TrialRow]:
        """Trials matching every filter given, oldest first."""

    @abc.abstractmethod
    def measured(self, group: TrialGroup) -> dict[str, TrialRow]:
        """The trials of `group` by config key, whatever their status: what a resumed
        search never measures again."""

    @abc.abstractmethod
    def delete_trials(self, group: TrialGroup, statuses: Collection[str]) -> int:
        """Delete `group`'s trials of these statuses so they are measured again; returns
        how many. Raises ValueError for 'ok' (winners name those) or an unknown status."""

    @abc.abstractmethod
    def supersede_timings(self, group: TrialGroup) -> int:
        """Delete `group`'s 'ok' trials, and the winner rows that name one of them (that
        shape has no winner until one is chosen again), so a new measurement of the group
        (a re-timing under another protocol) is the only timing left; returns how many
        trials. Failed, timeout and wrong trials stay: they are facts about the configs."""

    @abc.abstractmethod
    def replace_winner(self, device_id: int, software_id: int, shape_key: str,
                       sources: Mapping[str, str],
                       choose: Callable[[Sequence[TrialRow]], TrialRow | None],
                       ) -> Winner | None:
        """Store the winner of a shape as `choose` picks it among the candidates: every
        trial of the shape on this device and stack whose (backend, source hash) is in
        `sources`, oldest first. When `choose` returns None the stored winner is removed
        and None returned; else the stored winner is returned. Raises ValueError when the
        choice is not a candidate. Which trial wins is the caller's policy
        (`mla_tune.results.selection`); the store makes reading and storing one step, so
        `choose` runs inside it and must not call the store."""

    @abc.abstractmethod
    def winners(self, device_hash: str | None = None, software_hash: str | None = None,
                shape_key: str | None = None) -> list[Winner]:
        """Stored winners, optionally of one device, stack and/or shape."""

    @property
    @abc.abstractmethod
    def skipped(self) -> list[str]:
        """The rows reads so far skipped, each with why (damaged or foreign rows)."""

    # Maintenance

    @abc.abstractmethod
    def sources(self) -> list[SourceRow]:
        """Every (backend, kernel source) with trials, by backend, oldest source first."""

    @abc.abstractmethod
    def delete_sources(self, sources: Collection[tuple[str, str]]) -> DeletedRows:
        """Delete the trials and claims of these (backend, source hash) pairs. A trial a
        winner names is kept, with its winner, so other stacks' reports stay whole."""

    @abc.abstractmethod
    def rename_source(self, backend: str, old: str, new: str) -> RenamedRows:
        """Move the trials, claims and winners of (backend, `old`) to `new`: results of
        unchanged kernel code that a new hashing scheme names differently. A trial or claim
        whose key `new` already has stays under `old`, and so does a winner naming it."""

    @abc.abstractmethod
    def compact(self) -> None:
        """Give the space of deleted rows back to the file system, where the database
        keeps it otherwise."""
