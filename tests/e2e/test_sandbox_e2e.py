"""The shared sandbox with the real API and worker: a parent writes a marker
to the workdir and one to the sandbox temp area and starts a background
process and a server on the tree's loopback; its child reads both markers,
sees the process and fetches from the server (one network namespace); once
the sandbox is idle the worker's periodic sweep releases it: the workdir
file remains, the temp file and the process are gone."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.e2e.helpers import (client, create_agent, create_session, post_input, result_of,
                               wait_for, wait_turn_done)
from yuxi.services import resources, sandbox

pytestmark = pytest.mark.e2e

# Unique to this test process: another test session on the machine has its own.
MARK = f"sleep 300.{os.getpid()}"
# The parent's server on the tree's own loopback; the child fetches from it.
SERVE = "python3 -m http.server 18080 --bind 127.0.0.1"
FETCH = ("for i in $(seq 100); do python3 -c \"import urllib.request; print(urllib.request"
         ".urlopen('http://127.0.0.1:18080/notes/marker.txt').read().decode())\" "
         "2>/dev/null && break; sleep 0.1; done")


def script() -> dict:
    return {
        "rules": [
            {"match": "^check", "steps": [
                {"call": [{"tool": "read_file", "args": {"path": "notes/marker.txt"}},
                          {"tool": "run_command", "args": {
                              # Only the sleeper's own args start with MARK.
                              "command": f"cat \"$TMPDIR/marker\"; ps -eo args | grep -q '^{MARK}' "
                                         f"&& echo alive; {FETCH}"}}]},
                {"say": "{{ results[0].content }}|{{ results[1].output|trim|replace('\\n', ',') }}"},
            ]},
        ],
        "default": [
            {"call": [{"tool": "write_file", "args": {"path": "notes/marker.txt",
                                                      "content": "workdir marker"}},
                      {"tool": "run_command", "args": {"command": "echo tmp marker > \"$TMPDIR/marker\""}},
                      {"tool": "run_command", "args": {"command": MARK,
                                                       "background": True}},
                      {"tool": "run_command", "args": {"command": SERVE, "background": True}}]},
            {"call": [{"tool": "create_session", "args": {"name": "reader", "task": "check"}}]},
            {"call": [{"tool": "wait_inputs", "args": {"input_ids": "{{ [last.input_id] }}",
                                                       "timeout_s": 60}}]},
            {"call": [{"tool": "get_result", "args": {"input_id": "{{ results[4].input_id }}"}}]},
            {"say": "child saw: {{ last.output.text }}"},
        ],
    }


def sleeper_alive() -> bool:
    return subprocess.run(["pgrep", "-f", MARK], capture_output=True).returncode == 0


async def test_members_share_the_sandbox_until_the_worker_releases_it(
        start_worker, start_api, alice, pool, pg, data_dir):
    # The worker's periodic release_idle_sandboxes runs every second here
    # (only the sweep's period is a setting; the 5 idle minutes are fixed).
    # It boots while the API does.
    start_worker(YUXI_SANDBOX_SWEEP_SECONDS="1")
    api = start_api()
    key, scope = alice
    await resources.create(pool, scope.app_id, "tool_group:sandbox")
    await resources.grant(pool, scope, "tool_group:sandbox")
    try:
        async with client(api, key) as http:
            agent = await create_agent(http, {
                "model": "replay", "replay": script(), "resources": ["tool_group:sandbox"],
                "tools": ["cooperation", "read_file", "write_file", "run_command"]})
            root = await create_session(http, agent["id"])
            receipt = await post_input(http, root["id"], "go")
            turn = await wait_turn_done(http, receipt["turn_id"], timeout=40)
            result = await result_of(http, receipt["turn_id"])
            history = (await http.get(f"/api/sessions/{root['id']}/messages")).json()
        assert turn["status"] == "completed", result["error"]
        assert result["output"]["text"] == "child saw: workdir marker|tmp marker,alive,workdir marker", history
        assert sleeper_alive()
        box = sandbox.locate(data_dir, root["tree_id"], 1)
        assert (box.tmp / "marker").exists()
        assert pg.scalar("SELECT status FROM yuxi.sandboxes") == "active"
        # The sandbox has been idle for more than five minutes: its last
        # activity moves back. The worker's next sweep releases it.
        moved = pg.scalar("UPDATE yuxi.sandboxes SET last_activity_at = now() - interval "
                          "'6 minutes' RETURNING tree_id")
        assert str(moved) == root["tree_id"]

        async def released():
            return pg.scalar("SELECT status FROM yuxi.sandboxes") == "released"
        await wait_for(released, 10, "the worker to release the idle sandbox")
        assert pg.scalar("SELECT generation FROM yuxi.sandboxes") == 1
        assert (box.workdir / "notes" / "marker.txt").read_text() == "workdir marker"
        assert not box.tmp.exists()
        assert not sleeper_alive()
    finally:
        subprocess.run(["pkill", "-f", MARK])
