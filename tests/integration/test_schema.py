"""The fresh-only schema: creation, version check, catalog hygiene, and the
foreign keys that make wrong ownership impossible."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from yuxi import schema
from yuxi.errors import SchemaVersionMismatch

# Indexes of one table with the same columns, expressions, predicate and
# operator classes are duplicates: one of them is dead weight on every write.
DUPLICATE_INDEXES = """
SELECT c.relname AS table_name, array_agg(i.indexrelid::regclass::text ORDER BY 1) AS indexes
FROM pg_index i
JOIN pg_class c ON c.oid = i.indrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'yuxi'
GROUP BY c.relname, i.indrelid, i.indkey::text, coalesce(pg_get_expr(i.indexprs, i.indrelid), ''),
         coalesce(pg_get_expr(i.indpred, i.indrelid), ''), i.indclass::text
HAVING count(*) > 1
"""


async def test_apply_twice_is_a_noop(db_url):
    assert await schema.apply_schema(db_url) == "unchanged"


async def test_other_version_is_refused_naming_both(db_url, postgresql):
    postgresql.execute("UPDATE yuxi.meta SET schema_version = '0.9'")
    postgresql.commit()
    with pytest.raises(SchemaVersionMismatch) as err:
        await schema.apply_schema(db_url)
    assert "0.9" in str(err.value) and f"version {schema.SCHEMA_VERSION}" in str(err.value)


async def test_partial_schema_is_refused(db_url, postgresql):
    postgresql.execute("DROP TABLE yuxi.meta")
    postgresql.commit()
    with pytest.raises(SchemaVersionMismatch, match="partial"):
        await schema.apply_schema(db_url)


def test_no_duplicate_indexes(postgresql):
    assert postgresql.execute(DUPLICATE_INDEXES).fetchall() == []


def test_duplicate_index_check_finds_one(postgresql):
    # Negative case: the catalog query must see a duplicate when there is one.
    postgresql.execute("CREATE INDEX dup_idx ON yuxi.runs (turn_id, id)")
    rows = postgresql.execute(DUPLICATE_INDEXES).fetchall()
    assert rows and rows[0][0] == "runs"


def test_check_constraints_are_named(postgresql):
    unnamed = postgresql.execute(
        """SELECT conname FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
           WHERE n.nspname = 'yuxi' AND contype = 'c' AND conname ~ '_check[0-9]*$'"""
    ).fetchall()
    assert unnamed == []


def test_frozen_configs_are_stored_with_lz4(postgresql):
    # This server has lz4 (Debian's PostgreSQL is built with it): the columns
    # that repeat a frozen config compress with it, the others keep pglz.
    has_lz4 = postgresql.execute(
        "SELECT 'lz4' = ANY (enumvals) FROM pg_settings "
        "WHERE name = 'default_toast_compression'").fetchone()[0]
    assert has_lz4
    rows = dict(postgresql.execute(
        """SELECT attrelid::regclass || '.' || attname, attcompression FROM pg_attribute
           WHERE attrelid IN ('yuxi.agents'::regclass, 'yuxi.sessions'::regclass,
                              'yuxi.inputs'::regclass, 'yuxi.runs'::regclass,
                              'yuxi.events'::regclass)
             AND attname IN ('config', 'context_snapshot', 'data')""").fetchall())
    assert rows == {"yuxi.agents.config": "l", "yuxi.sessions.config": "l",
                    "yuxi.inputs.context_snapshot": "l", "yuxi.runs.config": "l",
                    "yuxi.events.data": ""}
    user, app = _scope(postgresql)
    big = '{"system_prompt": "%s"}' % ("be brief. " * 600)
    session = postgresql.execute(
        "SELECT id FROM yuxi.create_root_session_v1(%s, %s, NULL, NULL, %s)",
        (user, app, big)).fetchone()[0]
    assert postgresql.execute(
        "SELECT pg_column_compression(config), config->>'system_prompt' = %s "
        "FROM yuxi.sessions WHERE id = %s", ("be brief. " * 600, session)).fetchone() \
        == ("lz4", True)


def _scope(conn: psycopg.Connection) -> tuple[uuid.UUID, uuid.UUID]:
    user = conn.execute("INSERT INTO yuxi.users (name) VALUES ('u') RETURNING id").fetchone()[0]
    app = conn.execute("INSERT INTO yuxi.apps (name) VALUES ('a') RETURNING id").fetchone()[0]
    return user, app


def _root(conn, user, app) -> uuid.UUID:
    return conn.execute(
        "SELECT id FROM yuxi.create_root_session_v1(%s, %s, NULL, NULL, '{}')", (user, app)
    ).fetchone()[0]


def test_child_in_another_tree_than_its_parent_is_rejected(postgresql):
    user, app = _scope(postgresql)
    root_a, root_b = _root(postgresql, user, app), _root(postgresql, user, app)
    insert = """INSERT INTO yuxi.sessions (id, tree_id, parent_id, user_id, app_id, name, path, config)
                VALUES (gen_random_uuid(), %s, %s, %s, %s, 'kid', '/root/kid', '{}')"""
    postgresql.execute(insert, (root_a, root_a, user, app))  # same tree: fine
    with pytest.raises(psycopg.errors.ForeignKeyViolation, match="sessions_parent_same_tree_fk"):
        postgresql.execute(insert, (root_b, root_a, user, app))


def test_child_in_another_scope_is_rejected(postgresql):
    user, app = _scope(postgresql)
    other = postgresql.execute("INSERT INTO yuxi.users (name) VALUES ('o') RETURNING id").fetchone()[0]
    root = _root(postgresql, user, app)
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        postgresql.execute(
            """INSERT INTO yuxi.sessions (id, tree_id, parent_id, user_id, app_id, name, path, config)
               VALUES (gen_random_uuid(), %s, %s, %s, %s, 'kid', '/root/kid', '{}')""",
            (root, root, other, app))


def test_run_of_a_turn_in_another_session_is_rejected(postgresql):
    user, app = _scope(postgresql)
    a, b = _root(postgresql, user, app), _root(postgresql, user, app)
    input_id = postgresql.execute(
        "SELECT yuxi.receive_input_v1(%s, %s, %s, 'hi', 'queue', '{}', NULL)", (a, user, app)
    ).fetchone()[0]
    turn = postgresql.execute("SELECT turn_id FROM yuxi.inputs WHERE id = %s", (input_id,)).fetchone()[0]
    with pytest.raises(psycopg.errors.ForeignKeyViolation, match="runs_turn_fk"):
        postgresql.execute(
            """INSERT INTO yuxi.runs (turn_id, session_id, tree_id, user_id, app_id, config)
               VALUES (%s, %s, %s, %s, %s, '{}')""", (turn, b, b, user, app))


def test_result_run_of_another_turn_is_rejected(postgresql):
    user, app = _scope(postgresql)
    a = _root(postgresql, user, app)
    first = postgresql.execute(
        "SELECT yuxi.receive_input_v1(%s, %s, %s, 'one', 'queue', '{}', NULL)", (a, user, app)
    ).fetchone()[0]
    postgresql.execute(
        "SELECT yuxi.receive_input_v1(%s, %s, %s, 'two', 'queue', '{}', NULL)", (a, user, app))
    run = postgresql.execute(
        "SELECT r.id FROM yuxi.runs r JOIN yuxi.inputs i ON i.turn_id = r.turn_id WHERE i.id = %s",
        (first,)).fetchone()[0]
    with pytest.raises(psycopg.errors.ForeignKeyViolation, match="turns_result_run_same_turn_fk"):
        postgresql.execute(
            """UPDATE yuxi.turns SET status = 'completed', finished_at = now(), result_run_id = %s
               WHERE status = 'queued'""", (run,))
