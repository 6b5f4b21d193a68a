"""Listing pages read O(page), whatever the page's depth: the keyset seek is
in the index condition of the plan psycopg ends up using (a generic plan of
a prepared statement), not a filter over every newer row."""

from __future__ import annotations

import re

import psycopg

from tests.integration.helpers import new_session
from yuxi import db
from yuxi.services import sessions


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


def _generic_plan(conn: psycopg.Connection, query: str) -> str:
    """EXPLAIN of `query`'s generic plan (what a prepared statement runs
    after its first executions), with every parameter a placeholder."""
    sql = db.QUERIES[query]
    names = []
    for name in re.findall(r"%\((\w+)\)s", sql):
        if name not in names:
            names.append(name)
    text = sql
    for i, name in enumerate(names, 1):
        text = text.replace(f"%({name})s", f"${i}")
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute("SET enable_seqscan = off")  # a tiny table would be scanned
    types = {"user_id": "uuid", "app_id": "uuid", "after_created": "timestamptz",
             "after_id": "uuid", "limit": "int"}
    conn.execute(f"PREPARE q ({', '.join(types[n] for n in names)}) AS {text}")
    args = {"user_id": "NULL::uuid", "app_id": "NULL::uuid", "after_created": "now()",
            "after_id": "gen_random_uuid()", "limit": "50"}
    plan = "\n".join(r[0] for r in conn.execute(
        f"EXPLAIN EXECUTE q ({', '.join(args[n] for n in names)})"))
    conn.execute("DEALLOCATE q")
    return plan


def test_a_deep_page_seeks_the_index(postgresql):
    plan = _generic_plan(postgresql, "list_root_sessions_after")
    cond = [line for line in plan.splitlines() if "Index Cond" in line]
    assert any("created_at" in line for line in cond), plan


def test_an_optional_keyset_condition_would_filter_instead(postgresql):
    # Negative case: the single statement with "cursor IS NULL OR ..." that
    # served every page: its generic plan cannot put the keyset in the index
    # condition.
    db.QUERIES["list_root_sessions_optional"] = db.QUERIES["list_root_sessions_after"].replace(
        "AND (s.created_at, s.id) < (%(after_created)s::timestamptz, %(after_id)s::uuid)",
        "AND (%(after_created)s::timestamptz IS NULL OR (s.created_at, s.id) < "
        "(%(after_created)s::timestamptz, %(after_id)s::uuid))")
    try:
        plan = _generic_plan(postgresql, "list_root_sessions_optional")
    finally:
        del db.QUERIES["list_root_sessions_optional"]
    cond = [line for line in plan.splitlines() if "Index Cond" in line]
    assert not any("created_at" in line for line in cond), plan
