"""Table definitions and the versioned, create-on-first-use schema.

Every key column starts with ``tenant`` so that one database can serve several
tenants without one tenant's rows ever answering another's lookups. Times the
store stamps are epoch seconds from the database clock (a DOUBLE), so they sort
and compare the same on SQLite and PostgreSQL.
"""

from __future__ import annotations

import sqlalchemy as sa

from ._ops import StoreConnection
from .errors import SchemaVersionError

#: 2: ``coder_state_journal.deadline`` (the attempt's turn deadline; nullable, so
#: rows written by version 1 load as "no deadline recorded").
#: 3: ``coder_state_tool_ledger.marker`` / ``.attempt`` / ``.args_fp`` / ``.replay_of``
#: (which step attempt made a call, its (tool, arguments) fingerprint, and the earlier
#: attempt's call whose recorded output it returned; nullable, so rows written by
#: earlier versions load as "no attempt recorded" and are never matched).
#: 4: ``coder_state_workflows`` (a new table, created by ``create_all``: every workflow
#: the product starts, with what the reconciler needs to resume it; issue 29).
SCHEMA_VERSION = 4
COMPONENT = "prefect-coder-state"

metadata = sa.MetaData()

schema_version = sa.Table(
    "coder_state_schema_version",
    metadata,
    sa.Column("component", sa.Text, primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

checkpoints = sa.Table(
    "coder_state_checkpoints",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column("workflow_id", sa.Text, primary_key=True),
    sa.Column("chat_id", sa.Text, nullable=False),
    sa.Column("last_seen_message_id", sa.BigInteger, nullable=True),
    sa.Column("updated_at", sa.Double, nullable=False),
    # The resume cursor pairs with its chat id and is never stored without it.
    sa.CheckConstraint("chat_id <> ''", name="ck_checkpoint_chat_id"),
    sa.CheckConstraint(
        "last_seen_message_id IS NULL OR last_seen_message_id > 0", name="ck_checkpoint_cursor"
    ),
)

journal = sa.Table(
    "coder_state_journal",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column("chat_id", sa.Text, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("marker", sa.Text, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    # Added in schema version 2 (ALTER TABLE on a version-1 database): the attempt's
    # turn deadline, epoch seconds; NULL for rows written before and for verdicts.
    sa.Column("deadline", sa.Double, nullable=True),
    sa.CheckConstraint("state IN ('submitting', 'resumed', 'cut-short')", name="ck_journal_state"),
    sa.CheckConstraint("attempt >= 0", name="ck_journal_attempt"),
)

tool_ledger = sa.Table(
    "coder_state_tool_ledger",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column("chat_id", sa.Text, primary_key=True),
    sa.Column("tool_call_id", sa.Text, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("tool_name", sa.Text, nullable=True),
    sa.Column("args_json", sa.Text, nullable=True),
    sa.Column("output_json", sa.Text, nullable=True),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    # Added in schema version 3 (ALTER TABLE on an older database), see LEDGER_V3_COLUMNS:
    # the step attempt that made the call (the chat's journal entry at its write-ahead),
    # the fingerprint of (tool name, canonical JSON arguments), and — for a call of a
    # resubmitted attempt answered from an earlier attempt's applied call — that call's id.
    sa.Column("marker", sa.Text, nullable=True),
    sa.Column("attempt", sa.Integer, nullable=True),
    sa.Column("args_fp", sa.Text, nullable=True),
    sa.Column("replay_of", sa.Text, nullable=True),
    sa.CheckConstraint("state IN ('committing', 'done')", name="ck_ledger_state"),
    # A done entry always carries its output (JSON text, possibly "null").
    sa.CheckConstraint("state <> 'done' OR output_json IS NOT NULL", name="ck_ledger_output"),
)

stranded_chats = sa.Table(
    "coder_state_stranded_chats",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column("chat_id", sa.Text, primary_key=True),
    sa.Column("workflow_id", sa.Text, nullable=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

leases = sa.Table(
    "coder_state_leases",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("holder", sa.Text, nullable=False),
    sa.Column("fence", sa.BigInteger, nullable=False),
    sa.Column("acquired_at", sa.Double, nullable=False),
    sa.Column("expires_at", sa.Double, nullable=False),
)

workflows = sa.Table(
    "coder_state_workflows",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    # What is tracked: ``workflow:<id>`` (agent-workflow, agent-turn, recover-turn runs
    # of one workflow id: the latest run wins), ``shard:<digest>``, ``fanout:<digest>``.
    sa.Column("key", sa.Text, primary_key=True),
    # The Prefect deployment to rerun (``flow-name/deployment-name``) and ALL the
    # parameters of the run, as JSON: block names only, never a token.
    sa.Column("deployment", sa.Text, nullable=False),
    sa.Column("parameters_json", sa.Text, nullable=False),
    sa.Column("workflow_id", sa.Text, nullable=True),
    sa.Column("flow_run_id", sa.Text, nullable=True),
    # JSON list of the lease keys whose renewals show the run alive.
    sa.Column("lease_keys_json", sa.Text, nullable=False),
    # Recoveries the reconciler started since the workflow last started afresh.
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=True),
    # When the reconciler last acted on it (store clock; its backoff counts from here).
    sa.Column("acted_at", sa.Double, nullable=True),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
    sa.CheckConstraint("state IN ('running', 'done', 'gave-up')", name="ck_workflows_state"),
    sa.CheckConstraint("attempts >= 0", name="ck_workflows_attempts"),
)

#: Facts about the database itself, not about a tenant's work: ``store_id`` — a random
#: id written once, the store's identity. A chat's labels carry it, so a sweep acts only
#: on chats of its own store (issue 31). Additive (``create_all`` makes it; older code
#: ignores it), so no version bump: workers of the previous release keep working.
meta = sa.Table(
    "coder_state_meta",
    metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

ALL_TABLES = (
    schema_version,
    checkpoints,
    journal,
    tool_ledger,
    stranded_chats,
    leases,
    workflows,
    meta,
)

# Serialises concurrent first-use schema creation on PostgreSQL: concurrent
# CREATE TABLE IF NOT EXISTS can still collide on the catalog there.
_PG_SCHEMA_LOCK_ID = 0x636F646572  # "coder"


async def ensure_schema(conn: StoreConnection, now: sa.ColumnElement[float]) -> int:
    """Create the tables if missing and check the version, inside the caller's transaction.

    Returns the schema version found (or written). Raises SchemaVersionError if the
    database is newer than this code.
    """
    if conn.dialect.name == "postgresql":
        await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_PG_SCHEMA_LOCK_ID)))
    await conn.run_sync(lambda sync: metadata.create_all(sync, checkfirst=True))
    found = (
        await conn.execute(
            sa.select(schema_version.c.version).where(schema_version.c.component == COMPONENT)
        )
    ).scalar_one_or_none()
    if found is None:
        await conn.execute(
            schema_version.insert().values(
                component=COMPONENT, version=SCHEMA_VERSION, updated_at=now
            )
        )
        return SCHEMA_VERSION
    if found > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"the state database has schema version {found}, newer than this "
            f"prefect-coder understands ({SCHEMA_VERSION}); upgrade prefect-coder on this worker"
        )
    if found < 2:
        await _add_journal_deadline(conn)
    if found < 3:
        await _add_ledger_step_scope(conn)
    # found < 4: the workflows table is new, ``create_all`` above made it; only the
    # version is bumped (so a version-3 worker refuses the database instead of
    # starting workflows the reconciler would never see).
    if found < SCHEMA_VERSION:
        if conn.dialect.name == "postgresql":
            # The write fence (``fencing``): every write transaction reads this table
            # (ACCESS SHARE until it ends). ACCESS EXCLUSIVE waits for the writes in flight
            # that read the old version and holds new ones until the bump commits, so no
            # write of older code lands after it. (SQLite: writers are serial already.)
            await conn.execute(
                sa.text(f"LOCK TABLE {schema_version.name} IN ACCESS EXCLUSIVE MODE")
            )
        await conn.execute(
            schema_version.update()
            .where(schema_version.c.component == COMPONENT)
            .values(version=SCHEMA_VERSION, updated_at=now)
        )
    return SCHEMA_VERSION


async def _add_journal_deadline(conn: StoreConnection) -> None:
    """Version 1 → 2: the journal's nullable ``deadline`` column.

    Inside the caller's transaction (SQLite: BEGIN IMMEDIATE, PostgreSQL: under the
    advisory lock), so concurrent first users migrate once. Checked first anyway: a
    half-migrated database (column there, version not bumped) must not fail here.
    The version is bumped with it, so a worker still on version 1 refuses the
    database instead of upserting journal rows that keep a stale deadline.
    """
    columns = await conn.run_sync(
        lambda sync: {c["name"] for c in sa.inspect(sync).get_columns(journal.name)}
    )
    if "deadline" not in columns:
        await conn.execute(
            sa.text(f"ALTER TABLE {journal.name} ADD COLUMN deadline DOUBLE PRECISION")
        )


#: Version 2 → 3: the ledger's step-attempt columns, with their SQL types.
LEDGER_V3_COLUMNS = (
    ("marker", "TEXT"),
    ("attempt", "INTEGER"),
    ("args_fp", "TEXT"),
    ("replay_of", "TEXT"),
)


async def _add_ledger_step_scope(conn: StoreConnection) -> None:
    """Version 2 → 3: the tool ledger's nullable step-attempt columns.

    As :func:`_add_journal_deadline`: in the caller's transaction, each column checked
    first (a half-migrated database must not fail). Rows written before keep NULLs:
    no attempt recorded, so a resubmitted attempt never matches them (their effects
    keep their own keys, as before). The version is bumped with it, so a worker
    still on version 2 refuses the database instead of writing ledger rows without
    the columns a resubmitted attempt's match reads.
    """
    columns = await conn.run_sync(
        lambda sync: {c["name"] for c in sa.inspect(sync).get_columns(tool_ledger.name)}
    )
    for name, sql_type in LEDGER_V3_COLUMNS:
        if name not in columns:
            await conn.execute(
                sa.text(f"ALTER TABLE {tool_ledger.name} ADD COLUMN {name} {sql_type}")
            )
