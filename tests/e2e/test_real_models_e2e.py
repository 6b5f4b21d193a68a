"""Real models through an OpenAI-compatible provider: the loopback server of
tests/fake_provider.py is the external part (as the replay model is); the
API and worker are real processes. What the worker sent is read back from
the provider's request log, what clients see from the HTTP API and SSE.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.e2e.helpers import (client, create_agent, create_session, has_event, ok,
                               open_stream, post_input, wait_for, wait_turn_done)
from tests.fake_provider import FakeProvider, Reply

pytestmark = pytest.mark.e2e

MODEL = "fake/Qwen/Qwen2.5-7B-Instruct"  # split at the first "/"
KEY_ENV = "FAKE_PROVIDER_KEY"


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


@pytest.fixture
def secret() -> str:
    return f"sk-yuxi-test-{uuid.uuid4().hex}"


@pytest.fixture
def model_env(fake, secret, proc_env) -> dict[str, str]:
    providers = {"fake": {"base_url": fake.base_url, "api_key_env": KEY_ENV,
                          "models": ["Qwen/Qwen2.5-7B-Instruct"]}}
    proc_env.update(YUXI_PROVIDERS=json.dumps(providers), YUXI_MODEL_BACKOFF_SECONDS="0.05",
                    YUXI_MODEL_MAX_ATTEMPTS="3")
    # Only the worker gets the key: the API never needs it.
    return {KEY_ENV: secret}


def identity_of(request) -> str:
    return request.body["messages"][0]["content"]


async def test_real_model_turn_streams_records_usage_and_keeps_the_key_secret(
        fake, secret, model_env, start_api, start_worker, alice, pg, db_url):
    api1, api2 = start_api.many(2)
    worker = start_worker(**model_env)
    key, _ = alice
    tools = ["echo", "cooperation", "ask_user"]
    fake.script([
        Reply(match="hello", tool_calls=[{"name": "echo", "args": {"text": "hi"}}],
              usage=(11, 7)),
        Reply(match="hello", text="The echo said hi, and that is all there is to say.",
              chunk_size=3, chunk_delay=0.03, usage=(20, 9)),
    ])
    async with client(api1, key) as c1, client(api2, key) as c2:
        models = ok(await c1.get("/api/models"))["items"]
        assert {"id": MODEL, "provider": "fake"} in models
        assert {"id": "replay", "provider": "replay"} in models
        # Unknown providers or models: 422 unknown_model wherever a model is given.
        plain = await create_agent(c1, {"model": "replay"}, name="plain")
        for bad in ("fake/nope", "nope/Qwen/Qwen2.5-7B-Instruct", "fake"):
            r = await c1.post("/api/agents", json={"name": "x", "config": {"model": bad}})
            assert r.status_code == 422, r.text
            r = await c1.post("/api/sessions", json={"agent_id": plain["id"], "model": bad})
            assert r.status_code == 422 and r.json()["code"] == "unknown_model", r.text
        ok(await c1.post("/api/sessions", json={"agent_id": plain["id"], "model": MODEL}), 201)

        agent = await create_agent(c1, {"model": MODEL, "system_prompt": "You are terse.",
                                        "tools": tools})
        session = await create_session(c1, agent["id"])
        sid = session["id"]
        # SSE from the second API process: deltas reach every process.
        async with open_stream(c2, sid) as stream:
            turn_id = (await post_input(c1, sid, "hello"))["turn_id"]
            await stream.read_until(lambda s: s.deltas, timeout=30)
            assert not any(e["type"] == "turn.completed" for e in stream.events)
            await stream.read_until(has_event("turn.completed", turn_id=turn_id), timeout=30)
        final = [e for e in stream.events if e["type"] == "message"][-1]["data"]
        assert final["content"] == "The echo said hi, and that is all there is to say."
        deltas = [d for d in stream.deltas if d["data"]["message_id"] == final["message_id"]]
        assert len(deltas) >= 2
        assert "".join(d["data"]["delta"] for d in deltas) == final["content"]
        assert all(d["turn_id"] == turn_id and d["session_id"] == sid and d["run_id"]
                   for d in deltas)
        # Deltas are not stored.
        assert pg.one("SELECT count(*) AS n FROM yuxi.events WHERE type LIKE 'message.delta%%'"
                      )["n"] == 0

        first, second = fake.requests[:2]
        assert first.headers["authorization"] == f"Bearer {secret}"
        assert first.body["stream"] is True and first.body["model"] == "Qwen/Qwen2.5-7B-Instruct"
        roles = [m["role"] for m in first.body["messages"]]
        assert roles == ["system", "system", "user"], [r.body["messages"] for r in fake.requests]
        assert identity_of(first).startswith("You are Yuxi session") and sid in identity_of(first)
        assert first.body["messages"][1]["content"] == "You are terse."
        offered = {t["function"]["name"]: t["function"] for t in first.body["tools"]}
        assert set(offered) == {"echo", "ask_user", "create_session", "send_message",
                                "submit_input", "cancel_turn", "wait_sessions",
                                "list_sessions", "wait_inputs", "get_result"}
        assert offered["echo"]["parameters"] == {
            "type": "object", "properties": {"text": {"type": "string"}},
            "required": ["text"], "additionalProperties": False}
        assert offered["create_session"]["parameters"]["required"] == ["name", "task"]
        assert all(f["description"] for f in offered.values())
        # The tool round trip went back to the model.
        assert [m["role"] for m in second.body["messages"]][-2:] == ["assistant", "tool"]

        # Usage: per run, summed per turn, session and tree.
        turn = ok(await c1.get(f"/api/turns/{turn_id}"))
        assert turn["usage"] == {"prompt_tokens": 31, "completion_tokens": 16}
        assert turn["runs"][0]["usage"] == {"prompt_tokens": 31, "completion_tokens": 16}
        assert ok(await c1.get(f"/api/sessions/{sid}"))["usage"] == turn["usage"]

        # A child's first request holds no parent history.
        fake.script([
            Reply(match="make a child", tool_calls=[{"name": "create_session", "args": {
                "name": "kid", "task": "child task"}}], usage=(5, 5)),
            Reply(match="child task", text="child done", usage=(3, 2)),
            Reply(match="make a child", text="parent done", usage=(1, 1)),
        ])
        n = len(fake.requests)
        turn2 = (await post_input(c1, sid, "make a child"))["turn_id"]
        assert (await wait_turn_done(c1, turn2, timeout=30))["status"] == "completed"
        child_requests = await wait_for(
            lambda: _async([r for r in fake.requests[n:] if "'kid'" in identity_of(r)]),
            30, "the child's model call")
        child = child_requests[0]
        assert [m["role"] for m in child.body["messages"]] == ["system", "system", "user"]
        assert child.body["messages"][2]["content"] == "child task"
        assert "hello" not in json.dumps(child.body) and "make a child" not in json.dumps(
            child.body)
        tree = ok(await c1.get(f"/api/sessions/{sid}/tree"))
        assert len(tree["sessions"]) == 2
        kid = next(s for s in tree["sessions"] if s["name"] == "kid")
        await wait_for(lambda: _kid_done(c1, kid["id"]), 30, "the child's turn")
        tree_usage_total = ok(await c1.get(f"/api/sessions/{sid}/tree"))["usage"]
        assert tree_usage_total == {"prompt_tokens": 31 + 5 + 1 + 3,
                                    "completion_tokens": 16 + 5 + 1 + 2}

    # The key is in no table, snapshot, event or log.
    dump = subprocess.run(["pg_dump", "--data-only", db_url], capture_output=True, text=True,
                          check=True).stdout
    assert "yuxi.runs" in dump or "runs" in dump
    assert secret not in dump
    for proc in [*start_api.procs, worker]:
        assert secret not in proc.log(), proc.name


async def _async(value):
    return value


async def _kid_done(c, kid_id: str) -> bool:
    turns = ok(await c.get(f"/api/sessions/{kid_id}/turns"))
    return bool(turns) and turns[0]["status"] == "completed"


async def test_transient_errors_retry_and_others_fail_at_once(
        fake, secret, model_env, api, start_worker, alice):
    worker = start_worker(**model_env)
    key, _ = alice
    async with client(api, key) as c:
        session = await create_session(c, (await create_agent(c, {"model": MODEL}))["id"])
        sid = session["id"]

        # 500, then 429 with Retry-After, then an answer: three requests, one answer.
        fake.script([Reply(status=500, error="overloaded"),
                     Reply(status=429, error="slow down", headers={"retry-after": "0.1"}),
                     Reply(text="recovered")])
        n = len(fake.requests)
        turn = (await post_input(c, sid, "one"))["turn_id"]
        assert (await wait_turn_done(c, turn, 30))["status"] == "completed"
        assert ok(await c.get(f"/api/turns/{turn}/result"))["output"]["text"] == "recovered"
        assert len(fake.requests) - n == 3

        # A stream cut mid-answer is retried; the answer holds each delta once.
        fake.script([Reply(text="partial partial partial", break_after=2),
                     Reply(text="the whole answer")])
        n = len(fake.requests)
        turn = (await post_input(c, sid, "two"))["turn_id"]
        assert (await wait_turn_done(c, turn, 30))["status"] == "completed"
        assert ok(await c.get(f"/api/turns/{turn}/result"))["output"]["text"] == \
            "the whole answer"
        assert len(fake.requests) - n == 2

        # 401: no retry, the run fails naming provider, status and message.
        # A provider that echoes the key back never gets it into the error.
        fake.script([Reply(status=401, error=f"invalid api key {secret}")])
        n = len(fake.requests)
        turn = (await post_input(c, sid, "three"))["turn_id"]
        done = await wait_turn_done(c, turn, 30)
        assert done["status"] == "failed"
        assert done["error"] == "provider_error: 401 invalid api key *** (provider fake)"
        assert len(fake.requests) - n == 1
        assert secret not in worker.log()

        # Bounded attempts: 500s beyond YUXI_MODEL_MAX_ATTEMPTS fail the run.
        fake.requests.clear()
        fake.script([Reply(status=503, error="down")] * 3 + [Reply(text="too late")])
        turn = (await post_input(c, sid, "four"))["turn_id"]
        done = await wait_turn_done(c, turn, 30)
        assert done["status"] == "failed"
        assert done["error"].startswith("provider_error: 503 down"), done["error"]
        assert len(fake.requests) == 3


async def test_cancel_and_stop_abort_a_streaming_call_within_a_second(
        fake, model_env, api, start_worker, alice):
    start_worker(**model_env)
    key, _ = alice
    slow = "word " * 400  # 2 chars per 0.2 s: minutes of streaming
    async with client(api, key) as c:
        session = await create_session(c, (await create_agent(c, {"model": MODEL}))["id"])
        sid = session["id"]
        for how in ("cancel", "stop"):
            fake.script([Reply(match=f"slow {how}", text=slow, chunk_size=2, chunk_delay=0.2)])
            n = len(fake.requests)
            # The tree stream carries deltas too.
            async with open_stream(c, sid, scope="tree") as stream:
                turn = (await post_input(c, sid, f"slow {how}"))["turn_id"]
                await stream.read_until(lambda s: any(d["turn_id"] == turn for d in s.deltas),
                                        timeout=30)
                started = time.monotonic()
                if how == "cancel":
                    ok(await c.post(f"/api/turns/{turn}/cancel"), 202)
                else:
                    ok(await c.post(f"/api/sessions/{sid}/stop"), 202)
                await stream.read_until(has_event("turn.cancelled", turn_id=turn), timeout=10)
                latency = time.monotonic() - started
            assert latency < 1.0, f"{how}: turn.cancelled after {latency:.2f}s"
            request = fake.requests[n]
            await wait_for(lambda: _async(request.closed_at is not None), 2,
                           "the provider to see the request closed")
            assert not [e for e in stream.events if e["type"] == "message"
                        and e["turn_id"] == turn]
            if how == "stop":
                ok(await c.post(f"/api/sessions/{sid}/queue/continue"))

        # The conversation stays valid: the next call holds no partial text.
        fake.script([Reply(match="next", text="fine")])
        n = len(fake.requests)
        turn = (await post_input(c, sid, "next"))["turn_id"]
        assert (await wait_turn_done(c, turn, 30))["status"] == "completed"
        sent = fake.requests[n].body["messages"]
        assert [m["role"] for m in sent] == ["system", "user", "user", "user"], sent
        assert "word word" not in json.dumps(sent)


async def test_blocking_result_reads(api, worker, alice):
    key, _ = alice
    script = {"rules": [{"match": "^slow", "steps": [{"say": "late", "delay_ms": 4000}]}],
              "default": [{"say": "streamed answer here", "stream": True,
                           "chunk_delay_ms": 50}]}
    async with client(api, key) as c:
        agent = await create_agent(c, {"model": "replay", "replay": script})
        sid = (await create_session(c, agent["id"]))["id"]
        # POST ...inputs?wait= returns the created turn's terminal result.
        receipt = ok(await c.post(f"/api/sessions/{sid}/inputs", params={"wait": 20},
                                  json={"content": "go"}), 202)
        assert receipt["result"]["status"] == "completed"
        assert receipt["result"]["output"]["text"] == "streamed answer here"
        # Without wait: no result field.
        slow = await post_input(c, sid, "slow one")
        assert "result" not in slow
        started = time.monotonic()
        early = ok(await c.get(f"/api/turns/{slow['turn_id']}/result", params={"wait": 0.5}))
        assert early["status"] == "running" and 0.4 < time.monotonic() - started < 3
        started = time.monotonic()
        done = ok(await c.get(f"/api/turns/{slow['turn_id']}/result", params={"wait": 30},
                              timeout=40))
        assert done["status"] == "completed" and done["output"]["text"] == "late"
        # Woken by the turn's events (LISTEN), not at the deadline.
        assert time.monotonic() - started < 10
        r = await c.get(f"/api/turns/{slow['turn_id']}/result", params={"wait": 61})
        assert r.status_code in (400, 422), r.text
