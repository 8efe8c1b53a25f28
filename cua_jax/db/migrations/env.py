"""Alembic environment: runs on the connection `cua_jax.db.engine.migrate` hands it."""

from alembic import context

from cua_jax.db.models import VERSION_TABLE, Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",  # ALTER on SQLite via table copies
)
with context.begin_transaction():
    context.run_migrations()
