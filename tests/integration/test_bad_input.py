"""Bad input gets a clear answer, never a 500 (issue 12): NUL characters in
any text of a request body are 422 naming the field and write nothing; NUL
characters a model or a tool writes are stored as U+FFFD; every error body
has the one shape {code, message, errors}; body and content sizes have
configurable limits.

Real Litestar app in-process on a real database; the runs are executed by
the real executor."""

from __future__ import annotations

import psycopg
import pytest
from litestar.testing import AsyncTestClient
from psycopg.types.json import Jsonb

from tests.integration.helpers import drain, new_session, rows, scalar
from yuxi import db
from yuxi.api.app import create_app
from yuxi.settings import Settings

ERROR_KEYS = {"code", "message", "errors"}


@pytest.fixture
async def client(db_url):
    app = create_app(Settings(database_url=db_url, default_model="replay",
                              max_body_bytes=100_000, max_content_chars=1_000))
    async with AsyncTestClient(app=app) as c:
        yield c


@pytest.fixture
async def ctx(client, alice):
    headers = {"Authorization": f"Bearer {alice[0]}"}
    agent = (await client.post("/api/agents", headers=headers, json={
        "name": "a", "config": {"model": "replay",
                                "replay": {"default": [{"say": "ok"}]}}})).json()
    session = (await client.post("/api/sessions", headers=headers,
                                 json={"agent_id": agent["id"]})).json()
    return client, headers, agent, session


async def _counts(pool) -> dict:
    return {t: await scalar(pool, f"SELECT count(*) FROM yuxi.{t}")
            for t in ("agents", "sessions", "inputs", "turns", "events")}


@pytest.mark.parametrize("path,body,field", [
    ("/inputs", {"content": "a\u0000b"}, "content"),
    ("/inputs", {"content": "ok", "client_request_id": "r\u0000"}, "client_request_id"),
    ("/inputs", {"content": "ok", "model": "replay\u0000"}, "model"),
    ("", {"title": "t\u0000"}, "title"),
    ("agents", {"name": "n\u0000", "config": {}}, "name"),
    ("agents", {"name": "n", "config": {"system_prompt": "x\u0000y"}}, "config"),
    ("agents", {"name": "n", "config": {"tools": ["echo", "e\u0000"]}}, "config"),
    ("agents", {"name": "n", "config": {"k\u0000": 1}}, "config"),
    ("sessions", {"agent_id": None, "title": "\u0000"}, "title"),
])
async def test_nul_in_any_body_text_is_422_naming_the_field(ctx, pool, path, body, field):
    client, headers, agent, session = ctx
    if path == "agents":
        url = "/api/agents"
    elif path == "sessions":
        url, body = "/api/sessions", {**body, "agent_id": agent["id"]}
    else:
        url = f"/api/sessions/{session['id']}{path}"
    before = await _counts(pool)
    response = await client.post(url, json=body, headers=headers)
    assert response.status_code == 422, response.text
    answer = response.json()
    assert set(answer) == ERROR_KEYS and answer["code"] == "validation_error", answer
    fields = [e["field"] for e in answer["errors"]]
    assert any(f == field or f.startswith((f"{field}.", f"{field}[")) for f in fields), answer
    assert "NUL" in str(answer), answer
    assert await _counts(pool) == before


async def test_nul_in_turn_answers_is_422(ctx):
    client, headers, _, _ = ctx
    import uuid
    response = await client.post(f"/api/turns/{uuid.uuid4()}/answer", headers=headers,
                                 json={"answers": {"q": "a\u0000"}})
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "validation_error"


async def test_content_and_body_limits(ctx, pool):
    client, headers, _, session = ctx
    url = f"/api/sessions/{session['id']}/inputs"
    before = await _counts(pool)
    # Content over YUXI_MAX_CONTENT_CHARS (1,000 here): 422 naming content.
    response = await client.post(url, json={"content": "x" * 1_001}, headers=headers)
    assert response.status_code == 422, response.text
    assert set(response.json()) == ERROR_KEYS
    assert response.json()["errors"][0]["field"] == "content"
    # A body over YUXI_MAX_BODY_BYTES (100,000 here): 413 in the error shape.
    response = await client.post(url, json={"content": "x" * 200_000}, headers=headers)
    assert response.status_code == 413, response.text
    assert set(response.json()) == ERROR_KEYS
    assert response.json()["code"] == "payload_too_large"
    assert await _counts(pool) == before
    # At the limit: accepted.
    response = await client.post(url, json={"content": "x" * 1_000}, headers=headers)
    assert response.status_code == 202, response.text


async def test_default_body_limit_is_413_for_20_mb(db_url, alice):
    app = create_app(Settings(database_url=db_url))
    async with AsyncTestClient(app=app) as client:
        response = await client.post(
            "/api/agents", content=b'{"name": "a", "config": {"x": "' + b"y" * 20_000_000
            + b'"}}', headers={"Authorization": f"Bearer {alice[0]}",
                              "Content-Type": "application/json"})
    assert response.status_code == 413, response.text[:200]
    assert response.json()["code"] == "payload_too_large"


async def test_an_unexpected_error_is_500_in_the_error_shape(ctx, pool):
    """A database error that is not a connection fault is a bug: 500, with
    the one error shape and no internals."""
    client, headers, _, _ = ctx
    async with pool.connection() as conn:
        await conn.execute("ALTER TABLE yuxi.sessions RENAME TO sessions_gone")
    try:
        response = await client.get("/api/sessions", headers=headers)
    finally:
        async with pool.connection() as conn:
            await conn.execute("ALTER TABLE yuxi.sessions_gone RENAME TO sessions")
    assert response.status_code == 500, response.text
    assert response.json() == {"code": "internal_error", "message": "internal server error",
                               "errors": []}


async def test_unknown_route_and_method_use_the_error_shape(ctx):
    client, headers, _, session = ctx
    for response in (await client.get("/api/nothing-here", headers=headers),
                     await client.delete(f"/api/sessions/{session['id']}", headers=headers),
                     await client.post("/api/agents", content=b"{not json",
                                       headers={**headers,
                                                "Content-Type": "application/json"})):
        assert response.status_code in (400, 404, 405, 422), response.text
        assert set(response.json()) == ERROR_KEYS, response.text


# --------------------------------------------------------------------------
# Text written by models and tools

NUL_SCRIPT = {"rules": [{"match": "^go$", "steps": [
    {"call": [{"tool": "echo", "args": {"text": "{{ 'tool\\x00arg' }}"}},
              {"tool": "create_session", "args": {
                  "name": "kid", "task": "{{ 'task\\x00text' }}"}}]},
    {"say": "{{ 'answer\\x00' }} {{ results[0].text }}"},
]}], "default": [{"say": "child {{ '\\x00' }} done"}]}


async def test_nul_written_by_a_model_or_tool_is_stored_as_replacement(
        pool, checkpoint_pool, alice):
    _, scope = alice
    session = await new_session(pool, scope, {"model": "replay", "replay": NUL_SCRIPT,
                                              "tools": ["echo", "cooperation"]})
    from yuxi.services import sessions
    receipt = await sessions.receive_input(pool, scope, session.id, content="go",
                                           mode="queue", by_user=True)
    await drain(pool, checkpoint_pool)
    turn = (await rows(pool, "SELECT status, error FROM yuxi.turns WHERE id = %s",
                       (receipt.turn_id,)))[0]
    assert turn == {"status": "completed", "error": None}, turn
    events = await rows(pool, "SELECT type, data FROM yuxi.events WHERE turn_id = %s "
                              "ORDER BY seq", (receipt.turn_id,))
    started = [e["data"] for e in events if e["type"] == "tool.started"]
    assert {"text": "tool\ufffdarg"} in [s["args"] for s in started], started
    child_input = await scalar(pool, "SELECT content FROM yuxi.inputs WHERE session_id <> %s",
                               (session.id,))
    assert child_input == "task\ufffdtext"
    output = await scalar(pool, "SELECT r.output->>'text' FROM yuxi.turns t "
                                "JOIN yuxi.runs r ON r.id = t.result_run_id WHERE t.id = %s",
                          (receipt.turn_id,))
    assert output.startswith("answer\ufffd"), output


async def test_without_the_nul_safe_adapters_postgresql_refuses_nul(db_url):
    """The negative of the above: psycopg's own dumpers send NUL, which
    PostgreSQL text (22021) and jsonb (22P05) refuse."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        with pytest.raises(psycopg.DataError):
            await conn.execute("SELECT %s::text", ("a\x00b",))
        with pytest.raises(psycopg.errors.UntranslatableCharacter):
            await conn.execute("SELECT %s::jsonb", (Jsonb({"a": "\x00"}),))
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True,
                                                     context=db.ADAPTERS) as conn:
        cur = await conn.execute("SELECT %s::text, %s::jsonb",
                                 ("a\x00b", Jsonb({"a": "\x00", "b": "\\u0000"})))
        assert await cur.fetchone() == ("a\ufffdb", {"a": "\ufffd", "b": "\\u0000"})
