"""Listing pages read O(page), whatever the page's depth, and are not
re-planned at every call: the keyset seek is in the index condition of the
plan PostgreSQL uses, and that plan is a generic one (planned once per
connection), not a custom plan made for each call's parameters."""

from __future__ import annotations

import re

import psycopg

from tests.integration.helpers import new_session, rewrite_function_sync
from yuxi import db
from yuxi.services import sessions

# The old first page: the statement with the LIMIT parameter PostgreSQL
# re-planned at every call (benchmarks/README.md, queries at scale).
PLAIN_FIRST_PAGE = """
SELECT s.id, v.status, v.queue_length
FROM yuxi.sessions s
JOIN yuxi.session_status_v v ON v.session_id = s.id
WHERE s.user_id = %(user_id)s AND s.app_id = %(app_id)s AND s.parent_id IS NULL
ORDER BY s.created_at DESC, s.id DESC
LIMIT %(limit)s"""


async def test_pages_list_every_root_once_newest_first(pool, alice, mallory):
    scope = alice[1]
    made = [(await new_session(pool, scope)).id for _ in range(7)]
    await new_session(pool, mallory[1])
    seen, cursor = [], None
    while True:
        page, cursor = await sessions.list_sessions(pool, scope, limit=3, cursor=cursor)
        seen += [s.id for s in page]
        if cursor is None:
            break
    assert seen == list(reversed(made))


def _many_roots(conn: psycopg.Connection, n: int = 2000) -> dict:
    """n root sessions of one scope (in SQL, like benchmarks.scale), analyzed."""
    user = conn.execute("INSERT INTO yuxi.users (name) VALUES ('plans') RETURNING id").fetchone()[0]
    app = conn.execute("INSERT INTO yuxi.apps (name) VALUES ('plans') RETURNING id").fetchone()[0]
    conn.execute(
        "INSERT INTO yuxi.trees (id, user_id, app_id, created_at) "
        "SELECT md5('plans:' || i)::uuid, %(u)s, %(a)s, now() - i * interval '1 s' "
        "FROM generate_series(1, %(n)s::int) i", {"u": user, "a": app, "n": n})
    conn.execute(
        "INSERT INTO yuxi.sessions (id, tree_id, user_id, app_id, name, path, config, created_at) "
        "SELECT id, id, user_id, app_id, 'root', '/root', '{}', created_at FROM yuxi.trees "
        "WHERE user_id = %s", (user,))
    conn.commit()
    conn.execute("ANALYZE yuxi.trees, yuxi.sessions, yuxi.turns")
    conn.commit()
    return {"user_id": user, "app_id": app}


def _nested_plans(conn: psycopg.Connection, query: str, params: dict, calls: int = 12) -> str:
    """The plans of the statements `query` runs inside functions at its last
    of `calls` executions (auto_explain, this session only)."""
    for _ in range(calls - 1):
        conn.execute(query, params).fetchall()
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("LOAD 'auto_explain'")
    for setting, value in (("log_min_duration", "0"), ("log_nested_statements", "on"),
                           ("log_level", "notice")):
        conn.execute(f"SET auto_explain.{setting} = {value}")
    conn.execute(query, params).fetchall()
    conn.execute("SET auto_explain.log_min_duration = -1")
    conn.commit()
    return "\n".join(n for n in notices if "yuxi.sessions s" in n)


def _index_conds(plan: str) -> list[str]:
    return [line for line in plan.splitlines()
            if "Index Cond" in line and "user_id" in line]


def test_a_deep_page_seeks_the_index_with_a_generic_plan(postgresql):
    scope = _many_roots(postgresql)
    after = postgresql.execute(
        "SELECT created_at, id FROM yuxi.sessions WHERE user_id = %s "
        "ORDER BY created_at DESC, id DESC OFFSET 1900 LIMIT 1", (scope["user_id"],)).fetchone()
    plan = _nested_plans(postgresql, db.QUERIES["list_root_sessions_after"],
                         {**scope, "limit": 51, "after_created": after[0], "after_id": after[1]})
    cond = _index_conds(plan)
    # The keyset is in the index condition, and its values are parameters
    # ($n): a generic plan, not one made for these values.
    assert cond and "created_at" in cond[0] and re.search(r"\$\d", cond[0]), plan


def test_the_first_page_keeps_a_generic_plan(postgresql):
    scope = _many_roots(postgresql)
    plan = _nested_plans(postgresql, db.QUERIES["list_root_sessions"], {**scope, "limit": 51})
    cond = _index_conds(plan)
    assert cond and re.search(r"\$\d", cond[0]), plan
    assert "sessions_roots_idx" in plan, plan


def test_without_the_forced_generic_plan_every_call_is_planned_again(postgresql):
    # Negative case 1: the listing as a plain prepared statement (as it was)
    # gets a custom plan at every execution: its LIMIT parameter makes the
    # generic plan look dearer than planning again.
    scope = _many_roots(postgresql)
    for _ in range(12):
        postgresql.execute(PLAIN_FIRST_PAGE, {**scope, "limit": 51}).fetchall()
    generic, custom = postgresql.execute(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
        "WHERE statement LIKE '%%LIMIT $3'").fetchone()
    assert (generic, custom) == (0, 7)  # prepared at the 6th execution
    postgresql.commit()
    # Negative case 2: the function without its SET: custom plans (the
    # parameters' values in the index condition).
    rewrite_function_sync(postgresql, "yuxi.list_root_sessions_v1",
                          " SET plan_cache_mode TO 'force_generic_plan'", "")
    postgresql.commit()
    plan = _nested_plans(postgresql, db.QUERIES["list_root_sessions"], {**scope, "limit": 51})
    cond = _index_conds(plan)
    assert cond and not re.search(r"\$\d", cond[0]), plan
