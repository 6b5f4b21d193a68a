"""Fresh-only schema: create everything on an empty database, accept a
database of the same version as is, refuse any other version.

There are no upgrade paths: a schema change bumps SCHEMA_VERSION and needs a
fresh database.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import psycopg
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg.rows import dict_row

from yuxi import db
from yuxi.errors import SchemaVersionMismatch

def _schema_digest() -> str:
    """A digest of the schema files: any change to them is a new version, so
    a database built from other SQL is refused, never silently used."""
    digest = hashlib.sha256()
    for path in sorted(db.SQL_DIR.glob("[0-9][0-9][0-9]_*.sql")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


SCHEMA_VERSION = f"1.{_schema_digest()}"

# Serializes concurrent `yuxi db init` runs on one database.
_INIT_LOCK_KEY = 0x59_55_58_49  # "YUXI"


def schema_files() -> list:
    return sorted(p for p in db.SQL_DIR.glob("[0-9][0-9][0-9]_*.sql"))


async def installed_version(conn: psycopg.AsyncConnection) -> str | None:
    """The schema version of the database, None when yuxi is not installed."""
    cur = await conn.execute("SELECT to_regclass('yuxi.meta') IS NOT NULL AS present")
    row = await cur.fetchone()
    if not row[0]:
        cur = await conn.execute(
            "SELECT 1 FROM pg_namespace WHERE nspname IN ('yuxi', %s)",
            (db.PROCRASTINATE_SCHEMA,),
        )
        if await cur.fetchone():
            raise SchemaVersionMismatch(
                "the database has a partial or foreign yuxi schema (no yuxi.meta); "
                f"use a fresh database for schema version {SCHEMA_VERSION}"
            )
        return None
    cur = await conn.execute("SELECT schema_version FROM yuxi.meta")
    row = await cur.fetchone()
    return row[0] if row else None


async def apply_schema(url: str) -> str:
    """Install the schema into the database at `url`. Returns "created" or
    "unchanged"; raises SchemaVersionMismatch for another version."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SELECT pg_advisory_lock(%s)", (_INIT_LOCK_KEY,))
        try:
            version = await installed_version(conn)
            if version == SCHEMA_VERSION:
                return "unchanged"
            if version is not None:
                raise SchemaVersionMismatch(
                    f"the database has yuxi schema version {version}, this code needs "
                    f"version {SCHEMA_VERSION}; the schema is fresh-only: use a new database"
                )
            await _setup_checkpointer(url)
            async with conn.transaction():
                await conn.execute(f"CREATE SCHEMA {db.PROCRASTINATE_SCHEMA}")
                await conn.execute(f"SET LOCAL search_path = {db.PROCRASTINATE_SCHEMA}")
                procrastinate_sql = (
                    resources.files("procrastinate.sql") / "schema.sql"
                ).read_text(encoding="utf-8")
                await conn.execute(procrastinate_sql)
                await conn.execute("SET LOCAL search_path = pg_catalog, public")
                for path in schema_files():
                    await conn.execute(path.read_text())
                await conn.execute(
                    "INSERT INTO yuxi.meta (schema_version) VALUES (%s)", (SCHEMA_VERSION,)
                )
            return "created"
        finally:
            await conn.execute("SELECT pg_advisory_unlock(%s)", (_INIT_LOCK_KEY,))


async def _setup_checkpointer(url: str) -> None:
    """LangGraph's checkpoint tables, in their own schema (setup is idempotent
    and uses CREATE INDEX CONCURRENTLY, so it runs outside our transaction)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {db.CHECKPOINT_SCHEMA}")
    async with await psycopg.AsyncConnection.connect(
        db.with_search_path(url, db.CHECKPOINT_SCHEMA),
        autocommit=True,
        prepare_threshold=0,
        row_factory=dict_row,
    ) as conn:
        await AsyncPostgresSaver(conn).setup()


async def ensure_database(url: str) -> bool:
    """Create the database named in `url` if it is missing. True if created."""
    name = db.database_name(url)
    maintenance = db.with_database(url, "postgres")
    async with await psycopg.AsyncConnection.connect(maintenance, autocommit=True) as conn:
        cur = await conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
        if await cur.fetchone():
            return False
        try:
            await conn.execute(
                psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name))
            )
        except psycopg.errors.DuplicateDatabase:
            return False
        return True
