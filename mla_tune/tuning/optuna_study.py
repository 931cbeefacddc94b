"""Everything mla-tune asks of Optuna's storage and studies, in one place: opening the
storage in the tuning DB, naming, creating and deleting our studies, and heartbeating the
trials a sweep has out for measurement.

Our trial table is the source of truth; a study mirrors the measurements of one (tuning
key, backend) so the samplers learn from them and optuna-dashboard can show them. Optuna's
tables share the tuning DB under their own names; other tools' studies may live there too
and are never touched.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage
from sqlalchemy.exc import DBAPIError

# Optuna creates its tables without a lock; a process racing another on a fresh DB fails
# with "already exists" (or a lock error) and succeeds when it tries again.
_OPEN_ATTEMPTS = 5
_PREFIX = "mla-tune"


def open_storage(url: str, engine_kwargs: Mapping[str, Any], *, heartbeat_s: int | None = None,
                 grace_s: int | None = None) -> RDBStorage:
    """Optuna's storage at `url` (the tuning DB's, password included), creating its tables
    on first use. With `heartbeat_s`, trials asked for can be heartbeated
    (`record_heartbeat`), and those of a process that died are failed after `grace_s` by
    `fail_stale_trials`, instead of staying RUNNING forever (which would mislead TPE's
    constant liar)."""
    for attempt in range(1, _OPEN_ATTEMPTS):
        try:
            return _open(url, engine_kwargs, heartbeat_s, grace_s)
        except (DBAPIError, optuna.exceptions.StorageInternalError):
            time.sleep(0.2 * attempt)
    return _open(url, engine_kwargs, heartbeat_s, grace_s)


def _open(url: str, engine_kwargs: Mapping[str, Any], heartbeat_s: int | None,
          grace_s: int | None) -> RDBStorage:
    with warnings.catch_warnings():  # heartbeat_interval is "experimental"
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(url, engine_kwargs=dict(engine_kwargs),
                          heartbeat_interval=heartbeat_s, grace_period=grace_s)


def study_name(device_hash: str, software_hash: str, shape_key: str, backend: str,
               source_hash: str) -> str:
    """One study per (tuning key, backend), as the DB key defines it."""
    return f"{_PREFIX}:{device_hash}:{software_hash}:{shape_key}:{backend}:{source_hash}"


def study_source(name: str) -> tuple[str, str] | None:
    """(backend, source hash) of a study named by `study_name`; None for any other study
    (Optuna studies of other tools may share the database)."""
    parts = name.split(":")
    if len(parts) != 6 or parts[0] != _PREFIX:
        return None
    return parts[4], parts[5]


def study_sources(storage: BaseStorage) -> dict[str, tuple[str, str]]:
    """Our studies in `storage`: name -> (backend, source hash)."""
    found = {}
    for study in storage.get_all_studies():
        source = study_source(study.study_name)
        if source is not None:
            found[study.study_name] = source
    return found


def open_study(storage: BaseStorage, name: str,
               sampler: optuna.samplers.BaseSampler) -> optuna.Study:
    """The study `name` in `storage`, created on first use; it minimizes the time."""
    return optuna.create_study(storage=storage, study_name=name, load_if_exists=True,
                               direction="minimize", sampler=sampler)


def delete_studies(storage: BaseStorage, names: Iterable[str]) -> int:
    """Delete these studies with their trials; returns how many."""
    count = 0
    for name in names:
        optuna.delete_study(study_name=name, storage=storage)
        count += 1
    return count


# Heartbeats. Optuna heartbeats trials only inside `Study.optimize`; a sweep asks and tells
# (several trials out at once, measured by workers), so it records them itself through the
# study's storage by trial id. Optuna's public API exposes neither a study's storage nor a
# trial's id, so `Study._storage` and `Trial._trial_id` are read here and nowhere else. The
# check itself uses the storages' public `get_heartbeat_interval`, not Optuna's private
# `storages._heartbeat` module.

def heartbeat_enabled(study: optuna.Study) -> bool:
    """Whether `study`'s storage heartbeats trials (opened with `heartbeat_s`)."""
    interval = getattr(study._storage, "get_heartbeat_interval", None)
    return interval is not None and interval() is not None


def ask(study: optuna.Study,
        distributions: Mapping[str, optuna.distributions.BaseDistribution]) -> optuna.Trial:
    """A new trial of `study` over `distributions`. Optuna warns that a heartbeating storage
    is meant for `Study.optimize`; asking and telling with heartbeats is what we want."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        return study.ask(dict(distributions))


def record_heartbeat(study: optuna.Study, trial: optuna.Trial) -> None:
    """Mark `trial` (asked, not told yet) alive, so `fail_stale_trials` leaves it."""
    study._storage.record_heartbeat(trial._trial_id)


def fail_stale_trials(study: optuna.Study) -> None:
    """Fail the trials of `study` whose process stopped heartbeating them (killed while
    they were out), so the samplers do not wait on them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
