"""The tuning database: trials, winners and the fingerprints they were measured on.

`BaseTuningStore` is the contract every store keeps; `TuningStore` keeps it on SQLite and
PostgreSQL.
"""

from mla_tune.db.base import BaseTuningStore
from mla_tune.db.failures import db_failure
from mla_tune.db.rows import (
    STAT_KEYS,
    ClaimRow,
    DBError,
    DeletedRows,
    DeviceRow,
    RenamedRows,
    SourceRow,
    TrialGroup,
    TrialResult,
    TrialRow,
)
from mla_tune.db.store import TuningStore
from mla_tune.db.urls import (
    default_db_path,
    resolve_url,
    shipped_db_path,
    shipped_db_url,
    sqlite_file_size,
)

__all__ = ["STAT_KEYS", "BaseTuningStore", "ClaimRow", "DBError", "DeletedRows", "DeviceRow",
           "RenamedRows", "SourceRow", "TrialGroup", "TrialResult", "TrialRow", "TuningStore",
           "db_failure", "default_db_path", "resolve_url", "shipped_db_path",
           "shipped_db_url", "sqlite_file_size"]
