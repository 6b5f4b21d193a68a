"""Queries at scale: the service's reads and hot transitions on a large,
bulk-generated database, at two scales (to show cost growing like log n).

    python -m benchmarks.scale [--scales 0.1,1] [--iterations N]
                               [--database-url URL] [--readme]

For each scale (1 = 100k sessions in 10k trees, 200k turns/inputs/runs,
1M events, 1M checkpoints) the database is dropped, recreated with the
schema (yuxi.schema.apply_schema) and filled in SQL (INSERT ... SELECT
generate_series; every constraint and foreign key checked as usual), then
VACUUM ANALYZE. One user owns 90% of the trees (its session list is deep),
another the rest. Each tree: a root and 9 children; each session: 2
completed turns (input, turn, run); each tree: 100 events; each session:
10 checkpoints (thread_id = session id) and the latest one's blob. A few
live trees (one per 50) hold a running run with a slot and a pending run
waiting for one.

Each operation runs the SQL the service runs (the named queries of
sql/queries.sql and the yuxi.*_v1 functions), with parameters drawn at
random from the data set, on one connection configured like the app's pool
(autocommit, psycopg's prepare threshold 5, so the statements become
server-side prepared statements and PostgreSQL may switch to a generic
plan after 5 executions): a warm-up, then N timed executions (client wall
time of the statement's round trip). Transitions (receive, slot claim,
slot hand-over) run in a transaction that is rolled back, so every
iteration meets the same state. Then each query's generic plan with
EXPLAIN (ANALYZE, BUFFERS), and for the functions the plans of the
statements inside them (auto_explain, nested statements, on this session
only).

A report, not a test: it exits 0 whatever the numbers are. With --readme
the results replace the block between the scale markers in
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from benchmarks.run import fresh_database, percentile
from benchmarks.measure import CpuSnapshot

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/yuxi_scale"
README = Path(__file__).resolve().parent / "README.md"
BEGIN_MARK = "<!-- scale:begin (written by python -m benchmarks.scale --readme) -->"
END_MARK = "<!-- scale:end -->"

# At scale 1.
TREES = 10_000
PER_TREE = 10          # a root and 9 children: 100k sessions
TURNS_PER_SESSION = 2  # 200k turns, inputs, runs
EVENTS_PER_TREE = 100  # 1M events
CHECKPOINTS_PER_SESSION = 10  # 1M checkpoints
LIVE_EVERY = 50        # one live tree in 50
CONFIG = {"model": "replay", "approval_mode": "auto", "system_prompt": "", "tools": [],
          "max_steps": 25, "resources": [],
          "replay": {"default": [{"say": "ok {{ input }}"}]}}
TARGET_P99_MS = 5.0


# --------------------------------------------------------------------------
# Generation


def _sid(i: str, j: str) -> str:
    """SQL of the id of session j (0 = the root, whose id is the tree's) of tree i."""
    return (f"(CASE WHEN {j} = 0 THEN md5('tree:' || {i}) "
            f"ELSE md5('session:' || {i} || ':' || {j}) END)::uuid")


def _owner(i: str) -> str:
    return f"(CASE WHEN mod({i}, 10) = 0 THEN %(ub)s::uuid ELSE %(ua)s::uuid END)"


def _agent(i: str) -> str:
    return f"(CASE WHEN mod({i}, 10) = 0 THEN %(agent_b)s::uuid ELSE %(agent_a)s::uuid END)"


def _cid(n: str) -> str:
    """A checkpoint id that sorts like LangGraph's (time-ordered uuid6 text)."""
    return f"(lpad(to_hex({n}), 8, '0') || '-0000-6000-8000-000000000000')"


STEPS: list[tuple[str, str]] = [
    ("trees", f"""
        INSERT INTO yuxi.trees (id, user_id, app_id, created_at)
        SELECT md5('tree:' || i)::uuid, {_owner('i')}, %(app)s,
               %(t0)s + i * interval '1 second'
          FROM generate_series(%(lo)s::int, %(hi)s::int) i"""),
    ("root sessions", f"""
        INSERT INTO yuxi.sessions (id, tree_id, parent_id, user_id, app_id, agent_id,
                                   name, path, title, config, created_at)
        SELECT md5('tree:' || i)::uuid, md5('tree:' || i)::uuid, NULL, {_owner('i')}, %(app)s,
               {_agent('i')}, 'root', '/root', 'scale session ' || i, %(config)s,
               %(t0)s + i * interval '1 second'
          FROM generate_series(%(lo)s::int, %(hi)s::int) i"""),
    ("child sessions", f"""
        INSERT INTO yuxi.sessions (id, tree_id, parent_id, user_id, app_id, agent_id,
                                   name, path, title, config, created_at)
        SELECT {_sid('i', 'j')}, md5('tree:' || i)::uuid, md5('tree:' || i)::uuid,
               {_owner('i')}, %(app)s, {_agent('i')}, 'c' || j, '/root/c' || j,
               'member ' || j, %(config)s,
               %(t0)s + i * interval '1 second' + j * interval '1 millisecond'
          FROM generate_series(%(lo)s::int, %(hi)s::int) i,
               generate_series(1, %(per_tree)s::int - 1) j"""),
    # Input, turn and run of each completed turn in one statement: the turn
    # names its result run and the run its turn (immediate foreign keys both
    # ways, checked at the end of the statement, when all three are in).
    ("inputs, turns, runs", f"""
        WITH s AS (
            SELECT i, j, n, md5('tree:' || i)::uuid AS tree_id, {_sid('i', 'j')} AS session_id,
                   {_owner('i')} AS user_id,
                   md5('input:' || i || ':' || j || ':' || n)::uuid AS input_id,
                   md5('turn:' || i || ':' || j || ':' || n)::uuid AS turn_id,
                   md5('run:' || i || ':' || j || ':' || n)::uuid AS run_id,
                   %(t0)s + i * interval '1 second' + j * interval '1 millisecond'
                          + n * interval '10 microseconds' AS at
              FROM generate_series(%(lo)s::int, %(hi)s::int) i,
                   generate_series(0, %(per_tree)s::int - 1) j,
                   generate_series(1, %(turns)s::int) n
        ), ins_inputs AS (
            INSERT INTO yuxi.inputs (id, session_id, tree_id, user_id, app_id, content, mode,
                                     status, context_snapshot, turn_id, created_at,
                                     started_at, finished_at)
            SELECT input_id, session_id, tree_id, user_id, %(app)s, 'turn ' || n, 'queue',
                   'completed', %(config)s, turn_id, at, at, at FROM s
        ), ins_turns AS (
            INSERT INTO yuxi.turns (id, session_id, tree_id, user_id, app_id, input_id, status,
                                    result_run_id, created_at, started_at, finished_at)
            SELECT turn_id, session_id, tree_id, user_id, %(app)s, input_id, 'completed',
                   run_id, at, at, at FROM s
        ), ins_runs AS (
            INSERT INTO yuxi.runs (id, turn_id, session_id, tree_id, user_id, app_id, status,
                                   config, output, created_at, started_at, finished_at)
            SELECT run_id, turn_id, session_id, tree_id, user_id, %(app)s, 'completed',
                   %(config)s, jsonb_build_object('text', 'ok turn ' || n, 'messages', 2),
                   at, at, at FROM s
        )
        SELECT count(*) FROM s"""),
    # Live trees: member c1 has a running turn whose run holds a slot
    # (leased), member c2 a running turn whose run waits for one (pending).
    ("live trees", f"""
        WITH s AS (
            SELECT i, j, md5('tree:' || i)::uuid AS tree_id, {_sid('i', 'j')} AS session_id,
                   {_owner('i')} AS user_id,
                   md5('input:' || i || ':' || j || ':live')::uuid AS input_id,
                   md5('turn:' || i || ':' || j || ':live')::uuid AS turn_id,
                   md5('run:' || i || ':' || j || ':live')::uuid AS run_id
              FROM generate_series(%(lo)s::int, %(hi)s::int) i, generate_series(1, 2) j
             WHERE mod(i, %(live_every)s::int) = 1
        ), ins_inputs AS (
            INSERT INTO yuxi.inputs (id, session_id, tree_id, user_id, app_id, content, mode,
                                     status, context_snapshot, turn_id, started_at)
            SELECT input_id, session_id, tree_id, user_id, %(app)s, 'live', 'queue', 'started',
                   %(config)s, turn_id, now() FROM s
        ), ins_turns AS (
            INSERT INTO yuxi.turns (id, session_id, tree_id, user_id, app_id, input_id, status,
                                    started_at)
            SELECT turn_id, session_id, tree_id, user_id, %(app)s, input_id, 'running', now()
              FROM s
        ), ins_runs AS (
            INSERT INTO yuxi.runs (id, turn_id, session_id, tree_id, user_id, app_id, status,
                                   config, lease_token, lease_expires_at, started_at)
            SELECT run_id, turn_id, session_id, tree_id, user_id, %(app)s,
                   CASE j WHEN 1 THEN 'running' ELSE 'pending' END, %(config)s,
                   CASE j WHEN 1 THEN gen_random_uuid() END,
                   CASE j WHEN 1 THEN now() + interval '1 day' END,
                   CASE j WHEN 1 THEN now() END
              FROM s
        )
        SELECT count(*) FROM s"""),
    ("slot claims of the live runs", """
        INSERT INTO yuxi.slot_claims (run_id, tree_id)
        SELECT id, tree_id FROM yuxi.runs
         WHERE status = 'running' AND tree_id IN (
               SELECT md5('tree:' || i)::uuid FROM generate_series(%(lo)s::int, %(hi)s::int) i)"""),
    ("events", f"""
        INSERT INTO yuxi.events (tree_id, seq, user_id, app_id, session_id, turn_id, run_id,
                                 type, data, created_at)
        SELECT md5('tree:' || i)::uuid, q, {_owner('i')}, %(app)s,
               {_sid('i', 'q %% %(per_tree)s::int')},
               md5('turn:' || i || ':' || q %% %(per_tree)s::int || ':'
                   || 1 + (q / %(per_tree)s::int) %% %(turns)s::int)::uuid,
               md5('run:' || i || ':' || q %% %(per_tree)s::int || ':'
                   || 1 + (q / %(per_tree)s::int) %% %(turns)s::int)::uuid,
               (ARRAY['input.received', 'turn.started', 'run.started', 'message',
                      'run.completed', 'turn.completed'])[1 + q %% 6],
               CASE WHEN q %% 6 = 3
                    THEN jsonb_build_object('role', 'ai', 'text',
                                            'ok turn ' || q || ' ' || repeat('x', 120))
                    ELSE jsonb_build_object('input_id', md5('input:' || q)::uuid, 'mode', 'queue')
               END,
               %(t0)s + i * interval '1 second' + q * interval '1 millisecond'
          FROM generate_series(%(lo)s::int, %(hi)s::int) i,
               generate_series(1, %(events)s::int) q"""),
    ("checkpoints", f"""
        INSERT INTO langgraph.checkpoints (thread_id, checkpoint_ns, checkpoint_id,
                                           parent_checkpoint_id, type, checkpoint, metadata)
        SELECT {_sid('i', 'j')}::text, '', {_cid('n')},
               CASE WHEN n > 1 THEN {_cid('n - 1')} END, NULL,
               jsonb_build_object('v', 4, 'id', {_cid('n')}, 'ts', '2026-12-01T00:00:00+00:00',
                                  'channel_versions', jsonb_build_object(
                                      'messages', lpad(n::text, 32, '0') || '.0.5',
                                      '__start__', lpad(n::text, 32, '0') || '.0.3'),
                                  'versions_seen', jsonb_build_object(
                                      'model', jsonb_build_object(
                                          'branch:to:model', lpad(n::text, 32, '0') || '.0.4')),
                                  'updated_channels', jsonb_build_array('messages')),
               jsonb_build_object('source', 'loop', 'step', n, 'parents', '{{}}'::jsonb)
          FROM generate_series(%(lo)s::int, %(hi)s::int) i,
               generate_series(0, %(per_tree)s::int - 1) j,
               generate_series(1, %(checkpoints)s::int) n"""),
    ("checkpoint blobs (the latest checkpoint's messages)", f"""
        INSERT INTO langgraph.checkpoint_blobs (thread_id, checkpoint_ns, channel, version,
                                                type, blob)
        SELECT {_sid('i', 'j')}::text, '', 'messages',
               lpad(%(checkpoints)s::int::text, 32, '0') || '.0.5', 'msgpack',
               convert_to(repeat('m', 600), 'UTF8')
          FROM generate_series(%(lo)s::int, %(hi)s::int) i,
               generate_series(0, %(per_tree)s::int - 1) j"""),
]


@dataclass
class Scale:
    factor: float
    trees: int = 0
    sessions: int = 0
    turns: int = 0
    events: int = 0
    checkpoints: int = 0
    gen_seconds: float = 0.0
    db_bytes: int = 0
    ops: dict[str, Op] = field(default_factory=dict)


def generate(url: str, factor: float) -> tuple[Scale, dict[str, Any]]:
    """Fill the fresh database at `url`; returns the figures and the ids the
    operations draw from."""
    scale = Scale(factor, trees=max(LIVE_EVERY, round(TREES * factor)))
    began = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        def one(statement: str) -> Any:
            return conn.execute(statement).fetchone()[0]

        ua = one("INSERT INTO yuxi.users (name) VALUES ('scale-a') RETURNING id")
        ub = one("INSERT INTO yuxi.users (name) VALUES ('scale-b') RETURNING id")
        app = one("INSERT INTO yuxi.apps (name) VALUES ('scale') RETURNING id")
        agents = {}
        for name, user in (("a", ua), ("b", ub)):
            agents[name] = conn.execute(
                "INSERT INTO yuxi.agents (user_id, app_id, name, config) VALUES (%s, %s, %s, %s) "
                "RETURNING id", (user, app, "scale-agent", Jsonb(CONFIG))).fetchone()[0]
        params = {"ua": ua, "ub": ub, "app": app, "agent_a": agents["a"],
                  "agent_b": agents["b"], "config": Jsonb(CONFIG), "per_tree": PER_TREE,
                  "turns": TURNS_PER_SESSION, "events": EVENTS_PER_TREE,
                  "checkpoints": CHECKPOINTS_PER_SESSION, "live_every": LIVE_EVERY,
                  "t0": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}
        # Chunks of trees, one transaction each (bounded trigger queues).
        chunk = 1000
        for name, statement in STEPS:
            t = time.perf_counter()
            for lo in range(1, scale.trees + 1, chunk):
                hi = min(scale.trees, lo + chunk - 1)
                with conn.transaction():
                    conn.execute(statement, {**params, "lo": lo, "hi": hi})
            print(f"scale {factor:g}: {name} {time.perf_counter() - t:.1f} s", file=sys.stderr)
        t = time.perf_counter()
        conn.execute("VACUUM ANALYZE")
        print(f"scale {factor:g}: VACUUM ANALYZE {time.perf_counter() - t:.1f} s", file=sys.stderr)
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM yuxi.trees), (SELECT count(*) FROM yuxi.sessions),"
            " (SELECT count(*) FROM yuxi.turns), (SELECT count(*) FROM yuxi.events),"
            " (SELECT count(*) FROM langgraph.checkpoints), pg_database_size(current_database())"
        ).fetchone()
        scale.trees, scale.sessions, scale.turns, scale.events, scale.checkpoints, \
            scale.db_bytes = counts
        scale.gen_seconds = time.perf_counter() - began
        ids = _draw_ids(conn, ua, app)
    return scale, ids


def _draw_ids(conn: psycopg.Connection, ua: Any, app: Any) -> dict[str, Any]:
    """The parameters the operations draw from (user A's rows)."""
    rnd = "ORDER BY random() LIMIT 2000"
    roots = conn.execute(
        "SELECT created_at, id FROM yuxi.sessions WHERE user_id = %s AND parent_id IS NULL "
        "ORDER BY created_at DESC, id DESC", (ua,)).fetchall()
    # Deep pages: cursors in the oldest tenth that still leave a full page.
    deep = roots[int(len(roots) * 0.9):len(roots) - 60] or roots[-60:-59]
    live = conn.execute(
        "SELECT p.id AS pending, r.id AS holder FROM yuxi.runs p "
        "JOIN yuxi.runs r ON r.tree_id = p.tree_id AND r.status = 'running' "
        "WHERE p.status = 'pending' AND p.user_id = %s", (ua,)).fetchall()
    return {
        "user_id": ua, "app_id": app,
        "deep_cursors": deep,
        "trees": [r[0] for r in conn.execute(
            f"SELECT id FROM yuxi.trees WHERE user_id = %s {rnd}", (ua,))],
        "members": [r for r in conn.execute(
            f"SELECT tree_id, id FROM yuxi.sessions WHERE user_id = %s {rnd}", (ua,))],
        "turns": [r[0] for r in conn.execute(
            f"SELECT id FROM yuxi.turns WHERE user_id = %s AND status = 'completed' {rnd}",
            (ua,))],
        # Idle sessions (no turn in flight) of trees with no live run.
        "idle": [r[0] for r in conn.execute(
            "SELECT s.id FROM yuxi.sessions s WHERE s.user_id = %s AND NOT EXISTS ("
            " SELECT 1 FROM yuxi.runs r WHERE r.tree_id = s.tree_id"
            "  AND r.status IN ('pending', 'ready', 'running')) " + rnd, (ua,))],
        "live": live,
    }


# --------------------------------------------------------------------------
# Operations


@dataclass
class Op:
    name: str
    what: str
    statement: str  # psycopg text (named %(x)s parameters)
    params: Any  # callable(ids, rng) -> dict
    rolled_back: bool = False
    nested: bool = False  # a function call: show the plans of its statements
    checkpoint: bool = False  # on a checkpointer-like connection (langgraph schema)
    samples_ms: list[float] = field(default_factory=list)
    plan: str = ""
    buffers: int | None = None
    plan_counts: tuple[int, int] | None = None  # (generic, custom) executions

    @property
    def p50(self) -> float:
        return percentile(self.samples_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.samples_ms, 99)


def _latest_checkpoint_sql() -> str:
    from langgraph.checkpoint.postgres.base import BasePostgresSaver

    # AsyncPostgresSaver.aget_tuple without a checkpoint id.
    return (BasePostgresSaver.SELECT_SQL.replace("%", "%%") +
            "WHERE thread_id = %(thread)s AND checkpoint_ns = %(ns)s "
            "ORDER BY checkpoint_id DESC LIMIT 1")


def operations() -> list[Op]:
    from yuxi import db

    Q = db.QUERIES

    def scope(ids: dict) -> dict:
        return {"user_id": ids["user_id"], "app_id": ids["app_id"]}

    def deep(ids: dict, rng: random.Random) -> dict:
        created, id_ = rng.choice(ids["deep_cursors"])
        return {**scope(ids), "after_created": created, "after_id": id_, "limit": 51}

    def member(ids: dict, rng: random.Random) -> tuple[Any, Any]:
        return rng.choice(ids["members"])

    return [
        # The noise floor: a round trip that does nothing (on a busy machine
        # its p99 is the scheduler's, and so is every other operation's).
        Op("baseline: SELECT 1", "a round trip doing nothing: the noise floor of the machine",
           "SELECT 1 AS one WHERE %(x)s::int = 1", lambda ids, rng: {"x": 1}),
        Op("list, first page", "GET /api/sessions (51 rows)", Q["list_root_sessions"],
           lambda ids, rng: {**scope(ids), "limit": 51}, nested=True),
        Op("list, deep page", "GET /api/sessions?cursor= (a cursor in the oldest tenth)",
           Q["list_root_sessions_after"], deep, nested=True),
        Op("session", "get_session (the tree's and the SSE route's first read)",
           Q["get_session"], lambda ids, rng: {**scope(ids), "id": rng.choice(ids["trees"])}),
        Op("tree", "GET /api/sessions/{id}/tree (10 members)", Q["tree_sessions"],
           lambda ids, rng: {**scope(ids), "tree_id": rng.choice(ids["trees"]),
                             "parent": None, "after": "", "limit": 10_000}),
        Op("turn result", "GET /api/turns/{id}/result", Q["turn_result"],
           lambda ids, rng: {**scope(ids), "id": rng.choice(ids["turns"])}),
        Op("SSE replay, tree", "events_after seq 50 of the tree's 100 (scope=tree)",
           Q["events_after"],
           lambda ids, rng: {"tree_id": rng.choice(ids["trees"]), "after": 50,
                             "session_id": None, "limit": 500}),
        Op("SSE replay, session", "events_after seq 50, one member's events",
           Q["events_after"],
           lambda ids, rng: dict(zip(("tree_id", "session_id"), member(ids, rng)),
                                 after=50, limit=500)),
        Op("receive", "POST /api/sessions/{id}/inputs: receive_input_receipt_v1 on an idle "
           "session (starts the turn: run, slot, job, events); rolled back",
           Q["receive_input"],
           lambda ids, rng: {**scope(ids), "session_id": rng.choice(ids["idle"]),
                             "content": "scale", "mode": "queue", "overrides": None,
                             "client_request_id": f"scale-{rng.random()}", "by_user": True},
           rolled_back=True),
        Op("slot claim", "claim_slot_v1 of a pending run (a wait's resume); rolled back",
           "SELECT yuxi.claim_slot_v1(%(run_id)s)",
           lambda ids, rng: {"run_id": rng.choice(ids["live"])[0]}, rolled_back=True),
        Op("slot hand-over", "release_slot_v1 of a run holding a slot: the pending run "
           "of its tree gets it (fill_slots_v1, job deferred); rolled back",
           "SELECT yuxi.release_slot_v1(%(run_id)s)",
           lambda ids, rng: {"run_id": rng.choice(ids["live"])[1]}, rolled_back=True),
        Op("latest checkpoint", "AsyncPostgresSaver.aget_tuple (a run's start)",
           _latest_checkpoint_sql(),
           lambda ids, rng: {"thread": str(member(ids, rng)[1]), "ns": ""}, checkpoint=True),
    ]


def time_op(conn: psycopg.Connection, op: Op, ids: dict, iterations: int,
            warmup: int, rng: random.Random) -> None:
    # No collector pauses in the timed loop (the app freezes its heap after
    # startup and its collections are rare; here they were client-side
    # spikes of several ms in the operations returning many rows).
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        _time_loop(conn, op, ids, iterations, warmup, rng)
    finally:
        gc.enable()
        gc.unfreeze()


def _time_loop(conn: psycopg.Connection, op: Op, ids: dict, iterations: int,
               warmup: int, rng: random.Random) -> None:
    for k in range(warmup + iterations):
        params = op.params(ids, rng)
        if op.rolled_back:
            with conn.transaction(force_rollback=True):
                t = time.perf_counter()
                conn.execute(op.statement, params).fetchall()
                elapsed = time.perf_counter() - t
        else:
            t = time.perf_counter()
            conn.execute(op.statement, params).fetchall()
            elapsed = time.perf_counter() - t
        if k >= warmup:
            op.samples_ms.append(elapsed * 1000)
    # Which plans PostgreSQL used for this prepared statement.
    row = conn.execute(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
        "WHERE statement = %s", (_server_text(op.statement),)).fetchone()
    if row:
        op.plan_counts = (row["generic_plans"], row["custom_plans"])


def _server_text(statement: str) -> str:
    """The statement as psycopg sends it ($n placeholders)."""
    names: list[str] = []
    for name in re.findall(r"%\((\w+)\)s", statement):
        if name not in names:
            names.append(name)
    text = statement
    for i, name in enumerate(names, 1):
        text = text.replace(f"%({name})s", f"${i}")
    return text.replace("%%", "%")


def explain(conn: psycopg.Connection, op: Op, ids: dict, rng: random.Random) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of the statement's generic plan with real
    parameters; for a function, the plans of the statements it ran."""
    params = op.params(ids, rng)
    notices: list[str] = []
    if op.rolled_back or op.nested:
        # The statements inside the function, as they ran (plpgsql caches
        # its plans: these are the connection's warm ones).
        conn.execute("LOAD 'auto_explain'")
        for setting, value in (("log_min_duration", "0"), ("log_analyze", "on"),
                               ("log_buffers", "on"), ("log_timing", "on"),
                               ("log_nested_statements", "on"), ("log_level", "notice"),
                               ("log_format", "text")):
            conn.execute(f"SET auto_explain.{setting} = {value}")

        def handler(diag: psycopg.errors.Diagnostic) -> None:
            notices.append(diag.message_primary or "")

        conn.add_notice_handler(handler)
        try:
            with conn.transaction(force_rollback=True):
                conn.execute(op.statement, params).fetchall()
        finally:
            conn.remove_notice_handler(handler)
            conn.execute("SET auto_explain.log_min_duration = -1")
        op.plan = "\n\n".join(_trim_auto_explain(n) for n in notices)
        # The last notice is the top-level statement: its buffers include
        # those of the statements it ran.
        op.buffers = _buffers(notices[-1]) if notices else None
        return
    names: list[str] = []
    for name in re.findall(r"%\((\w+)\)s", op.statement):
        if name not in names:
            names.append(name)
    text = _server_text(op.statement)
    types = [_pg_type(params[n]) for n in names]
    conn.execute("SET plan_cache_mode = force_generic_plan")
    try:
        conn.execute(f"PREPARE scale_q ({', '.join(types)}) AS {text}")
        args = sql.SQL(", ").join(sql.Literal(params[n]) for n in names)
        rows = conn.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE scale_q ({})")
                            .format(args)).fetchall()
        op.plan = "\n".join(r["QUERY PLAN"] for r in rows)
        op.buffers = _buffers(op.plan)
    finally:
        conn.execute("DEALLOCATE ALL")
        conn.execute("RESET plan_cache_mode")


def _pg_type(value: Any) -> str:
    if value is None:
        return "uuid"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "bigint"
    if isinstance(value, dt.datetime):
        return "timestamptz"
    if isinstance(value, str):
        return "text"
    return "uuid"


def _trim_auto_explain(message: str) -> str:
    # "duration: 0.123 ms  plan:\nQuery Text: ...\n<plan>"
    return message.split("plan:\n", 1)[-1].strip()


def _buffers(plan: str) -> int | None:
    """Shared buffers (hit + read) of the first Buffers line (the top node's)."""
    for line in plan.splitlines():
        if "Buffers: shared" in line:
            return sum(int(x) for x in re.findall(r"(?:hit|read)=(\d+)", line.split("temp")[0]))
    return None


def measure(url: str, scale: Scale, ids: dict, iterations: int, warmup: int) -> None:
    from yuxi import db

    rng = random.Random(15)
    app_conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
    # The checkpointer's connections: langgraph first on the search path,
    # prepared at once (prepare_threshold=0), like db.checkpoint_pool.
    cp_conn = psycopg.connect(db.with_search_path(url, db.CHECKPOINT_SCHEMA), autocommit=True,
                              row_factory=dict_row, prepare_threshold=0)
    try:
        for op in operations():
            conn = cp_conn if op.checkpoint else app_conn
            time_op(conn, op, ids, iterations, warmup, rng)
            explain(conn, op, ids, rng)
            scale.ops[op.name] = op
            print(f"scale {scale.factor:g}: {op.name:<22} p50 {op.p50:6.3f} ms  "
                  f"p99 {op.p99:6.3f} ms  buffers {op.buffers}  plans (generic, custom) "
                  f"{op.plan_counts}", file=sys.stderr)
    finally:
        app_conn.close()
        cp_conn.close()


# --------------------------------------------------------------------------
# Report


def markdown(scales: list[Scale], iterations: int, load: float, elapsed: float) -> str:
    small, big = scales[0], scales[-1]
    today = dt.date.today().isoformat()
    out = [
        f"Measured {today} on this machine ({os.cpu_count()} vCPUs, PostgreSQL "
        f"{_server_version(scales)}, shared_buffers 128MB, the server shared with other "
        f"work: machine busy {load:.2f} cores on average during the timed loops). "
        f"`make bench-scale` took {elapsed / 60:.1f} min. {iterations} timed executions "
        "per operation and scale (after a warm-up), parameters drawn at random from the "
        "data set, client wall time of the statement's round trip on one connection.",
        "",
        "| data set | trees | sessions | turns (= inputs = runs) | events | checkpoints | "
        "database | generated in |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in scales:
        out.append(f"| scale {s.factor:g} | {s.trees:,} | {s.sessions:,} | {s.turns:,} | "
                   f"{s.events:,} | {s.checkpoints:,} | {s.db_bytes / 2**20:,.0f} MiB | "
                   f"{s.gen_seconds:.0f} s |")
    out += [
        "",
        f"| operation | p50 ms ({small.factor:g}) | p99 ms ({small.factor:g}) | "
        f"p50 ms ({big.factor:g}) | p99 ms ({big.factor:g}) | buffers ({small.factor:g} → "
        f"{big.factor:g}) | generic/custom plans ({big.factor:g}) | "
        f"p99 ≤ {TARGET_P99_MS:g} ms at scale {big.factor:g} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, op in big.ops.items():
        o1 = small.ops[name]
        counts = f"{op.plan_counts[0]}/{op.plan_counts[1]}" if op.plan_counts else "–"
        out.append(f"| {name} | {o1.p50:.3f} | {o1.p99:.3f} | {op.p50:.3f} | {op.p99:.3f} | "
                   f"{o1.buffers} → {op.buffers} | {counts} | "
                   f"{'met' if op.p99 <= TARGET_P99_MS else 'NOT met'} |")
    out += ["", "What each operation is:", ""]
    for name, op in big.ops.items():
        out.append(f"- **{name}**: {op.what}.")
    out += ["", f"Plans at scale {big.factor:g} (generic plans of the prepared statements, "
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) with real parameters; for the "
            "functions, auto_explain of every statement they ran, the outer call last):", ""]
    for name, op in big.ops.items():
        out += [f"<details><summary>{name}</summary>", "", "```", op.plan, "```", "",
                "</details>", ""]
    return "\n".join(out)


_VERSION = ""


def _server_version(scales: list[Scale]) -> str:
    return _VERSION


def write_readme(text: str) -> None:
    readme = README.read_text()
    if BEGIN_MARK in readme and END_MARK in readme:
        head, rest = readme.split(BEGIN_MARK, 1)
        _, tail = rest.split(END_MARK, 1)
        readme = f"{head}{BEGIN_MARK}\n{text}\n{END_MARK}{tail}"
    else:
        readme += f"\n{BEGIN_MARK}\n{text}\n{END_MARK}\n"
    README.write_text(readme)


def main(argv: list[str] | None = None) -> int:
    global _VERSION
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", default="0.1,1",
                   help="comma-separated scale factors, smallest first (1 = 100k sessions, "
                        "10k trees, 1M events, 1M checkpoints)")
    p.add_argument("--iterations", type=int, default=2000, help="timed executions per operation")
    p.add_argument("--warmup", type=int, default=50, help="untimed executions first")
    p.add_argument("--database-url",
                   default=os.environ.get("YUXI_SCALE_DATABASE_URL", DEFAULT_URL),
                   help=f"database to DROP and recreate (default {DEFAULT_URL})")
    p.add_argument("--readme", action="store_true",
                   help="write the results into benchmarks/README.md (between the scale markers)")
    a = p.parse_args(argv)
    began = time.perf_counter()
    scales: list[Scale] = []
    busy, wall = 0.0, 0.0
    for factor in (float(x) for x in a.scales.split(",")):
        print(f"scale {factor:g}: fresh database {a.database_url}", file=sys.stderr)
        asyncio.run(fresh_database(a.database_url))
        scale, ids = generate(a.database_url, factor)
        before, t = CpuSnapshot.take({}), time.perf_counter()
        measure(a.database_url, scale, ids, a.iterations, a.warmup)
        busy += CpuSnapshot.take({}).minus(before).busy
        wall += time.perf_counter() - t
        scales.append(scale)
    with psycopg.connect(a.database_url) as conn:
        _VERSION = conn.execute("SHOW server_version").fetchone()[0].split()[0]
    text = markdown(scales, a.iterations, busy / wall if wall else 0.0,
                    time.perf_counter() - began)
    print(text)
    if a.readme:
        write_readme(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
