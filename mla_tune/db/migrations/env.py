"""Alembic environment for mla-tune's own tables.

Migrations only run through `TuningStore`, which hands over an open connection inside the
transaction that serializes concurrent upgrades; there is no alembic.ini and no offline mode.
"""

from alembic import context

from mla_tune.db.models import VERSION_TABLE, Base, is_ours

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("mla-tune migrations run only via mla_tune.db.TuningStore, "
                       "which passes an open connection")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    include_name=is_ours,
)
with context.begin_transaction():
    context.run_migrations()
