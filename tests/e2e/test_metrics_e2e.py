"""Prometheus metrics with the real API and workers: the API's /metrics
(database figures: queue depth, pending runs per tree, slots in use, stuck
runs; its SSE subscribers) and a worker's own port (run and turn durations,
wake latency, provider call latency and errors, recoveries), parsed with
prometheus-client's own parser."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import free_port
from tests.e2e.helpers import (client, create_agent, create_session, has_event, open_stream,
                               post_input, wait_for, wait_turn_done)

pytestmark = pytest.mark.e2e

FANOUT = {"model": "replay", "tools": ["cooperation"], "replay": {"rules": [
    {"match": "^child", "steps": [{"say": "done", "delay_ms": 2500}]},
    {"match": "^boom", "steps": [{"say": "{{ nothing.at.all() }}"}]},
    {"match": "^long", "steps": [{"say": "late", "delay_ms": 20000}]},
], "default": [
    {"call": [{"tool": "create_session", "args": {"name": f"c{i}", "task": f"child {i}"}}
              for i in range(5)]},
    {"call": [{"tool": "wait_inputs", "args": {
        "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 60}}]},
    {"say": "all done"},
]}}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}"""
    response = httpx.get(url, timeout=5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples, name: str, **labels) -> float:
    """Sum over the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


async def test_api_and_worker_metrics(start_worker, api, alice, pg):
    key, _ = alice
    port = free_port()
    worker = start_worker(YUXI_WORKER_METRICS_PORT=str(port))
    worker_url = f"http://127.0.0.1:{port}/metrics"
    api_url = f"{api}/metrics"
    async with client(api, key) as http:
        agent = await create_agent(http, FANOUT)
        root = await create_session(http, agent["id"])

        # SSE subscribers of this API process.
        async with open_stream(http, root["id"]) as stream:
            assert value(scrape(api_url), "yuxi_sse_subscribers") == 1
            receipt = await post_input(http, root["id"], "fan out")
            # Five children, four slots: one child waits for a slot.
            async def crowded():
                s = scrape(api_url)
                return (value(s, "yuxi_pending_runs", tree_id=root["tree_id"]) == 1
                        and value(s, "yuxi_slots_in_use") == 4
                        and value(s, "yuxi_trees_at_capacity") == 1)
            await wait_for(crowded, 20, "one pending run and four slots in use")
            await stream.read_until(has_event("turn.completed", turn_id=receipt["turn_id"]),
                                    timeout=40)

        async def unsubscribed():
            return value(scrape(api_url), "yuxi_sse_subscribers") == 0
        await wait_for(unsubscribed, 10, "the closed stream to leave the hub")
        s = scrape(api_url)
        assert value(s, "yuxi_slots_in_use") == 0 and total(s, "yuxi_pending_runs") == 0

        # A model call that raises: a provider error, the turn fails.
        failing = await create_session(http, agent["id"])
        bad = await post_input(http, failing["id"], "boom")
        assert (await wait_turn_done(http, bad["turn_id"]))["status"] == "failed"

        w = scrape(worker_url)
        assert value(w, "yuxi_run_duration_seconds_count", outcome="completed") >= 6
        assert value(w, "yuxi_run_duration_seconds_count", outcome="suspended") >= 1
        assert value(w, "yuxi_run_duration_seconds_count", outcome="failed") >= 1
        assert value(w, "yuxi_turn_duration_seconds_count", status="completed") >= 6
        assert value(w, "yuxi_turn_duration_seconds_count", status="failed") >= 1
        assert value(w, "yuxi_wake_latency_seconds_count", kind="turn") >= 6
        assert value(w, "yuxi_wake_latency_seconds_count", kind="resume") >= 1
        assert total(w, "yuxi_provider_call_seconds_count") >= 8
        assert total(w, "yuxi_provider_call_errors_total") >= 1

        # The worker dies mid-run: a stuck run, and queued work nobody takes.
        stuck = await create_session(http, agent["id"])
        long = await post_input(http, stuck["id"], "long")
        await wait_for(lambda: _status(http, long["turn_id"], "running"), 20, "the long run")
        worker.kill9()
        idle = await create_session(http, agent["id"])
        await post_input(http, idle["id"], "child x")

        async def stuck_and_queued():
            s = scrape(api_url)
            return (value(s, "yuxi_stuck_runs", kind="lease_expired") == 1
                    and value(s, "yuxi_queue_depth", queue="runs") >= 1)
        await wait_for(stuck_and_queued, 20, "a stuck run and a queued job")

        # Another worker recovers it and counts the recovery.
        port2 = free_port()
        recovering = start_worker(YUXI_WORKER_METRICS_PORT=str(port2))

        async def recovered():
            try:
                w2 = scrape(f"http://127.0.0.1:{port2}/metrics")
            except httpx.HTTPError:
                return False
            return value(w2, "yuxi_recoveries_total", kind="lease_expired") >= 1
        await wait_for(recovered, 30, "the new worker's recovery")

        async def unstuck():
            return value(scrape(api_url), "yuxi_stuck_runs", kind="lease_expired") == 0
        await wait_for(unstuck, 10, "no stuck run")
        # The recovered run's 20 s model call would hold that worker's
        # graceful stop (a replay call is not aborted mid-call: it stops at
        # boundaries) past the teardown's 10 s: end it as the first one ended.
        recovering.kill9()


async def _status(http, turn_id: str, status: str) -> bool:
    return (await http.get(f"/api/turns/{turn_id}")).json()["status"] == status and \
        any(r["status"] == "running" for r in (await http.get(f"/api/turns/{turn_id}")).json()["runs"])
