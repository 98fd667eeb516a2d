"""Alembic environment of the usage store (run by :func:`hubext.metering.store.upgrade`).

The store shares the hub's database, so its revisions live in their own version table
(:data:`hubext.metering.schema.VERSION_TABLE`), beside JupyterHub's ``alembic_version``.
"""

from alembic import context

from hubext.metering.schema import VERSION_TABLE, metadata

config = context.config
connection = config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    transaction_per_migration=True,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
