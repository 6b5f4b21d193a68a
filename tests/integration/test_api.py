"""The HTTP contract of sessions and inputs, through the real Litestar app
in-process (real database; e2e tests drive the same over real HTTP)."""

from __future__ import annotations

import pytest
from litestar.testing import AsyncTestClient

from tests.integration.helpers import scalar, say_agent
from yuxi.api.app import create_app
from yuxi.settings import Settings


@pytest.fixture
async def client(db_url):
    app = create_app(Settings(database_url=db_url, default_model="replay/default"))
    async with AsyncTestClient(app=app) as c:
        yield c


@pytest.fixture
async def session(client, alice):
    headers = {"Authorization": f"Bearer {alice[0]}"}
    config = {"replay": say_agent()["replay"]}  # no model: the system default applies
    agent = (await client.post("/api/agents", json={"name": "a", "config": config},
                               headers=headers)).json()
    created = await client.post("/api/sessions", json={"agent_id": agent["id"]}, headers=headers)
    assert created.status_code == 201, created.text
    return created.json(), headers


async def test_empty_session_has_an_effective_model(client, session):
    body, headers = session
    assert body["model"] == "replay/default"
    got = (await client.get(f"/api/sessions/{body['id']}", headers=headers)).json()
    assert (got["model"], got["status"], got["queue"]) == (
        "replay/default", "idle", {"length": 0, "paused": False})


@pytest.mark.parametrize("payload,field", [
    ({"model": ""}, "model"), ({"model": "   "}, "model"), ({"model": None}, "model"),
    ({"approval_mode": None}, "approval_mode"), ({"approval_mode": "never"}, "approval_mode"),
    ({"title": None}, "title"), ({"system_prompt": "x"}, "system_prompt"),
    ({"model": "not-a-model"}, "model"), ({"tools": []}, "tools"),
])
async def test_update_refuses_bad_fields_with_422_naming_them(client, session, pool, payload, field):
    body, headers = session
    before = await scalar(pool, "SELECT config FROM yuxi.sessions")
    response = await client.post(f"/api/sessions/{body['id']}", json=payload, headers=headers)
    assert response.status_code == 422, response.text
    assert field in [e["field"] for e in response.json()["errors"]], response.json()
    assert await scalar(pool, "SELECT config FROM yuxi.sessions") == before


async def test_update_changes_only_what_is_given(client, session):
    body, headers = session
    response = await client.post(f"/api/sessions/{body['id']}",
                                 json={"model": "replay/other"}, headers=headers)
    assert response.status_code == 200
    assert (response.json()["model"], response.json()["approval_mode"]) == ("replay/other", "auto")
    response = await client.post(f"/api/sessions/{body['id']}", json={"title": "t"},
                                 headers=headers)
    assert (response.json()["model"], response.json()["title"]) == ("replay/other", "t")


async def test_receipt_and_waiting_for_user_conflict(client, session, pool):
    body, headers = session
    url = f"/api/sessions/{body['id']}/inputs"
    first = await client.post(url, json={"content": "a"}, headers=headers)
    assert first.status_code == 202
    receipt = first.json()
    assert set(receipt) == {"input_id", "session_id", "status", "turn_id", "mode", "position"}
    queued = (await client.post(url, json={"content": "b", "mode": "queue"}, headers=headers)).json()
    assert (queued["status"], queued["position"]) == ("queued", 1)
    await scalar(pool, "UPDATE yuxi.turns SET status = 'waiting_user' WHERE id = %s RETURNING id",
                 (receipt["turn_id"],))
    refused = await client.post(url, json={"content": "c"}, headers=headers)
    assert refused.status_code == 409
    assert refused.json()["code"] == "waiting_for_user"


@pytest.mark.parametrize("payload", [
    {}, {"content": ""}, {"content": "  "}, {"content": "x", "mode": "later"},
    {"content": "x", "model": ""}, {"content": "x", "extra": 1}, {"content": 5},
])
async def test_bad_inputs_are_422_and_write_nothing(client, session, pool, payload):
    body, headers = session
    response = await client.post(f"/api/sessions/{body['id']}/inputs", json=payload,
                                 headers=headers)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "validation_error"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.inputs") == 0


async def test_unknown_model_at_creation_is_422(client, session):
    _, headers = session
    agents = (await client.get("/api/agents", headers=headers)).json()
    response = await client.post("/api/sessions", json={"agent_id": agents[0]["id"],
                                                        "model": "gpt-x"}, headers=headers)
    assert response.status_code == 422 and response.json()["code"] == "unknown_model"


async def test_a_revoked_key_stops_working_after_the_cache_time(client, alice, pool, monkeypatch):
    from yuxi.api import auth
    headers = {"Authorization": f"Bearer {alice[0]}"}
    assert (await client.get("/api/agents", headers=headers)).status_code == 200
    await scalar(pool, "UPDATE yuxi.api_keys SET revoked_at = now() RETURNING 1")
    # Remembered for KEY_CACHE_SECONDS: no database round trip per request.
    assert (await client.get("/api/agents", headers=headers)).status_code == 200
    later = auth._clock() + auth.KEY_CACHE_SECONDS + 1
    monkeypatch.setattr(auth, "_clock", lambda: later)
    assert (await client.get("/api/agents", headers=headers)).status_code == 401
    assert (await client.get("/api/agents", headers=headers)).status_code == 401
