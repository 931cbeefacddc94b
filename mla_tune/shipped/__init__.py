"""Data shipped with mla-tune: `tuning.db`, the H200 tuning results (trials and winners).

It is read through `mla_tune.db.shipped_db_url()` (`--db shipped`), read-only, wherever
mla-tune is installed; a user's own sweeps write to their own DB (default ./tuning.db)."""
