"""yuxi.client against the real API and worker: the sync and async clients
run a turn end to end (SSE included) and map errors; every route the client
calls exists in the OpenAPI document (the contract). Negative: a route the
API does not have is caught by the same check."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from yuxi import client as yc

pytestmark = pytest.mark.e2e

SCRIPT = {"model": "replay", "tools": ["echo"], "replay": {"default": [
    {"call": [{"tool": "echo", "args": {"text": "{{ input }}"}}]},
    {"say": "echo said: {{ last.text }}"},
]}}


def missing_routes(schema: dict, routes: dict[str, yc.Route]) -> list[str]:
    paths = schema["paths"]
    return [f"{name}: {r.method} {r.path}" for name, r in routes.items()
            if r.method.lower() not in paths.get(r.path, {})]


def test_every_client_route_is_in_the_openapi_document(api):
    schema = httpx.get(f"{api}/schema/openapi.json").json()
    assert missing_routes(schema, yc.ROUTES) == []
    # Negative: a route the server does not have, or the wrong method, is caught.
    bogus = {"nope": yc.Route("GET", "/api/sessions/{session_id}/nope"),
             "wrong_method": yc.Route("DELETE", "/api/sessions/{session_id}")}
    assert len(missing_routes(schema, bogus)) == 2


def test_sync_client_runs_a_turn(worker, api, alice):
    key, _ = alice
    with yc.Client(api, key) as c:
        agent = c.create_agent("sync", SCRIPT)
        assert any(a.id == agent.id for a in c.list_agents())
        session = c.create_session(agent.id, title="sync")
        receipt = c.send_input(session.id, "hi there")
        seen = []
        for item in c.events(session.id):
            assert isinstance(item, yc.Event)
            seen.append(item.type)
            if item.type == "turn.completed":
                break
        assert seen[:2] == ["session.created", "input.received"] and "message" in seen
        result = c.get_result(receipt.turn_id)
        assert result.status == "completed" and result.output["text"] == "echo said: hi there"
        tree = c.tree(session.id)
        assert [m.path for m in tree.sessions] == ["/root"]
        assert tree.slots is not None and tree.slots.capacity == 4
        assert [t.id for t in c.turns(session.id)] == [receipt.turn_id]
        # The conversation, paged: human, ai (call), tool, ai (answer).
        whole = c.messages(session.id)
        assert [m["position"] for m in whole] == [1, 2, 3, 4]
        assert whole[-1]["content"] == "echo said: hi there"
        assert c.messages(session.id, limit=2) == whole[2:]
        assert c.messages(session.id, limit=2, before=3) == whole[:2]

        with pytest.raises(yc.ApiError) as missing:
            c.get_session("00000000-0000-0000-0000-000000000000")
        assert (missing.value.status, missing.value.code) == (404, "not_found")
        with pytest.raises(yc.ApiError) as invalid:
            c.send_input(session.id, "   ")
        assert invalid.value.status == 422 and invalid.value.errors

    with yc.Client(api, "yx_wrong") as bad, pytest.raises(yc.ApiError) as refused:
        bad.list_agents()
    assert refused.value.status == 401
    with yc.Client("http://127.0.0.1:9", key) as down, pytest.raises(yc.Unreachable):
        down.healthz()


async def test_async_client_resumes_a_stream_after_its_cursor(worker, api, alice):
    key, _ = alice
    async with yc.AsyncClient(api, key) as c:
        agent = await c.create_agent("async", SCRIPT)
        session = await c.create_session(agent.id)
        receipt = await c.send_input(session.id, "one")

        async def until_done(after: int | None) -> list[yc.Event]:
            out = []
            async for item in c.events(session.id, after=after):
                out.append(item)
                if item.type == "turn.completed" and item.turn_id == receipt.turn_id:
                    return out
            raise AssertionError("stream ended")

        events = await asyncio.wait_for(until_done(None), 30)
        seqs = [e.seq for e in events]
        assert seqs == list(range(1, len(seqs) + 1))
        # From a cursor: exactly the events after it, no duplicate.
        tail = await asyncio.wait_for(until_done(seqs[2]), 30)
        assert [e.seq for e in tail] == seqs[3:]
