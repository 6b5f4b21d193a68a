"""Scope over HTTP: another user's key gets 404 on every route of alice's
objects and writes nothing; a missing or unknown key is 401."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import (
    client, ok, post_input, result_of, session_with_script, wait_for, wait_turn_done,
)

pytestmark = pytest.mark.e2e

SCRIPT = {"default": [{"say": "secret answer to {{ input }}"}]}


async def alice_objects(c) -> dict[str, str]:
    """A session of alice with one completed turn."""
    session = await session_with_script(c, SCRIPT)
    receipt = await post_input(c, session["id"], "alice's question", mode="queue")
    assert (await wait_turn_done(c, receipt["turn_id"]))["status"] == "completed"
    return {"agent": session["agent_id"], "session": session["id"],
            "input": receipt["input_id"], "turn": receipt["turn_id"]}


def routes(ids: dict[str, str]) -> list[tuple[str, str, dict | None]]:
    s, i, t = ids["session"], ids["input"], ids["turn"]
    return [
        ("GET", f"/api/sessions/{s}", None),
        ("POST", f"/api/sessions/{s}", {"title": "pwned"}),
        ("POST", f"/api/sessions/{s}", {"model": "replay"}),
        ("POST", f"/api/sessions/{s}/inputs", {"content": "do my bidding"}),
        ("POST", f"/api/sessions/{s}/inputs", {"content": "queued", "mode": "queue",
                                               "client_request_id": "x"}),
        ("GET", f"/api/inputs/{i}", None),
        ("GET", f"/api/sessions/{s}/turns", None),
        ("GET", f"/api/turns/{t}", None),
        ("GET", f"/api/turns/{t}/result", None),
        ("GET", f"/api/sessions/{s}/messages", None),
        ("GET", f"/api/sessions/{s}/events", None),
        ("GET", f"/api/sessions/{s}/events?scope=tree", None),
        ("POST", "/api/sessions", {"agent_id": ids["agent"]}),
    ]


async def test_scope_404_and_401(worker, api, alice, mallory, pg):
    # One API and one worker for both parts: process start-up dominates.
    ids = await other_scope_gets_404_and_writes_nothing(api, alice, mallory, pg)
    await missing_or_bad_key_is_401(api, alice, ids, pg)


async def other_scope_gets_404_and_writes_nothing(api, alice, mallory, pg) -> dict[str, str]:
    key, _ = alice
    mkey, _ = mallory
    async with client(api, key) as c, client(api, mkey) as m:
        ids = await alice_objects(c)

        async def quiet() -> bool:  # the finished run's job is deleted
            return pg.run_jobs() == 0
        await wait_for(quiet, 10, "the run's job to be deleted")
        before_session = ok(await c.get(f"/api/sessions/{ids['session']}"))
        before_result = await result_of(c, ids["turn"])
        before = pg.counts()
        for method, url, body in routes(ids):
            response = await m.request(method, url, json=body)
            assert response.status_code == 404, (method, url, response.status_code,
                                                 response.text)
            error = response.json()
            assert error["code"] == "not_found", error
            # The body never echoes alice's data.
            assert "secret" not in response.text and "alice" not in response.text
        assert pg.counts() == before
        assert pg.scalar("SELECT title FROM yuxi.sessions WHERE id = %s",
                         (ids["session"],)) is None
        assert ok(await c.get(f"/api/sessions/{ids['session']}")) == before_session
        assert await result_of(c, ids["turn"]) == before_result

        # Lists: alice sees her session, mallory does not.
        mine = ok(await c.get("/api/sessions"))
        assert [s["id"] for s in mine["items"]] == [ids["session"]]
        theirs = ok(await m.get("/api/sessions", params={"limit": 200}))
        assert theirs["items"] == [] and theirs["next_cursor"] is None
        assert ok(await m.get("/api/agents")) == []

        # Mallory's own session works and stays apart from alice's.
        own = await session_with_script(m, SCRIPT, name="mallory")
        theirs = ok(await m.get("/api/sessions"))
        assert [s["id"] for s in theirs["items"]] == [own["id"]]
        assert own["tree_id"] != ids["session"]
    return ids


async def missing_or_bad_key_is_401(api, alice, ids, pg):
    key, _ = alice
    before = pg.counts()
    headers_cases = [
        {},  # no key
        {"Authorization": "Bearer yx_not-a-real-key"},
        {"Authorization": f"Bearer {key}x"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {key}"},
        {"Authorization": key},
    ]
    probes = [("GET", "/api/sessions", None),
              ("GET", f"/api/sessions/{ids['session']}", None),
              ("POST", f"/api/sessions/{ids['session']}/inputs", {"content": "hi"}),
              ("GET", f"/api/sessions/{ids['session']}/events", None),
              ("GET", f"/api/inputs/{ids['input']}", None),
              ("GET", f"/api/turns/{ids['turn']}/result", None),
              ("POST", f"/api/sessions/{ids['session']}", {"title": "anonymous"}),
              ("POST", "/api/agents", {"name": "x", "config": {}})]
    async with client(api, None) as anon:
        for headers in headers_cases:
            for method, url, body in probes:
                response = await anon.request(method, url, json=body, headers=headers)
                assert response.status_code == 401, (headers, method, url, response.text)
                assert response.json()["code"] == "unauthorized"
                assert response.headers.get("www-authenticate", "").lower().startswith("bearer")
        # Health endpoints need no key.
        assert (await anon.get("/api/healthz")).status_code == 200
    assert pg.counts() == before
