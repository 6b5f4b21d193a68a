"""The shared sandbox with the real API and worker: a parent writes a marker
to the workdir and one to the sandbox temp area and starts a background
process; its child reads both and sees the process; after the idle release
the workdir file remains, the temp file and the process are gone."""

from __future__ import annotations

import datetime as dt
import subprocess

import pytest

from tests.e2e.helpers import (client, create_agent, create_session, post_input, result_of,
                               wait_turn_done)
from yuxi.services import resources, sandbox

pytestmark = pytest.mark.e2e

MARK = "sleep 300.4242"


def script() -> dict:
    return {
        "rules": [
            {"match": "^check", "steps": [
                {"call": [{"tool": "read_file", "args": {"path": "notes/marker.txt"}},
                          {"tool": "run_command", "args": {
                              # Only the sleeper's own args start with MARK.
                              "command": f"cat \"$TMPDIR/marker\"; ps -eo args | grep -q '^{MARK}' "
                                         "&& echo alive"}}]},
                {"say": "{{ results[0].content }}|{{ results[1].output|trim|replace('\\n', ',') }}"},
            ]},
        ],
        "default": [
            {"call": [{"tool": "write_file", "args": {"path": "notes/marker.txt",
                                                      "content": "workdir marker"}},
                      {"tool": "run_command", "args": {"command": "echo tmp marker > \"$TMPDIR/marker\""}},
                      {"tool": "run_command", "args": {"command": MARK,
                                                       "background": True}}]},
            {"call": [{"tool": "create_session", "args": {"name": "reader", "task": "check"}}]},
            {"call": [{"tool": "wait_inputs", "args": {"input_ids": "{{ [last.input_id] }}",
                                                       "timeout_s": 60}}]},
            {"call": [{"tool": "get_result", "args": {"input_id": "{{ results[3].input_id }}"}}]},
            {"say": "child saw: {{ last.output.text }}"},
        ],
    }


def sleeper_alive() -> bool:
    return subprocess.run(["pgrep", "-f", MARK], capture_output=True).returncode == 0


async def test_members_share_the_sandbox_until_it_is_released(worker, api, alice, pool, data_dir):
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
        assert result["output"]["text"] == "child saw: workdir marker|tmp marker,alive", history
        assert sleeper_alive()
        box = sandbox.locate(data_dir, root["tree_id"], 1)
        assert (box.tmp / "marker").exists()
        # Five idle minutes later (the clock is injected) the sandbox goes.
        later = lambda: sandbox.utcnow() + dt.timedelta(minutes=6)  # noqa: E731
        released = await sandbox.release_idle(pool, data_dir, now=later)
        assert [str(t) for t in released] == [root["tree_id"]]
        assert (box.workdir / "notes" / "marker.txt").read_text() == "workdir marker"
        assert not box.tmp.exists()
        assert not sleeper_alive()
    finally:
        subprocess.run(["pkill", "-f", MARK])
