"""The tuning database: trials, winners and the fingerprints they were measured on."""

from mla_tune.db.store import (
    ClaimRow,
    DBError,
    DeletedRows,
    DeviceRow,
    RenamedRows,
    SourceRow,
    TrialGroup,
    TrialRow,
    TuningStore,
    WinnerRow,
    db_failure,
    default_db_path,
    resolve_url,
    shipped_db_url,
)

__all__ = ["ClaimRow", "DBError", "DeletedRows", "DeviceRow", "RenamedRows", "SourceRow",
           "TrialGroup", "TrialRow", "TuningStore", "WinnerRow", "db_failure",
           "default_db_path", "resolve_url", "shipped_db_url"]
