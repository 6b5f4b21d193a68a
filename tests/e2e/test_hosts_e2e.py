"""Two worker groups on this machine stand for two hosts (their own
YUXI_HOST_ID and YUXI_DATA_DIR) on one database: a tree's sandbox work
always lands on the group holding its live sandbox, trees without one spread
over both, and killing one group's workers moves its trees on once its
heartbeat expired and the sweep released them (the workdir was on its
disk: the next generation starts from an empty one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e.helpers import (client, create_agent, create_session, post_input, result_of,
                               wait_for, wait_turn_done)
from yuxi.services import resources

pytestmark = pytest.mark.e2e

SANDBOX_AGENT = {
    "model": "replay", "resources": ["tool_group:sandbox"], "tools": ["run_command"],
    "replay": {"default": [
        {"call": [{"tool": "run_command", "args": {
            "command": "echo {{ input }} >> turns.log; wc -l < turns.log"}}]},
        {"say": "lines: {{ last.output|trim }}"},
    ]},
}
PLAIN_AGENT = {"model": "replay", "replay": {"default": [{"say": "ok", "delay_ms": 800}]}}


def workdir(base: Path, tree_id: str) -> Path:
    return base / "workdirs" / tree_id


async def test_sandbox_affinity_across_two_worker_groups(start_worker, api, alice, pool, pg,
                                                         tmp_path):
    dirs = {h: tmp_path / h for h in ("host-a", "host-b")}
    workers = {h: start_worker(YUXI_HOST_ID=h, YUXI_DATA_DIR=str(d), YUXI_WORKER_CONCURRENCY="2",
                               YUXI_HOST_TIMEOUT_SECONDS="3")
               for h, d in dirs.items()}
    key, scope = alice
    await resources.create(pool, scope.app_id, "tool_group:sandbox")
    await resources.grant(pool, scope, "tool_group:sandbox")
    async with client(api, key) as http:
        boxed = await create_agent(http, SANDBOX_AGENT, name="boxed")
        plain = await create_agent(http, PLAIN_AGENT, name="plain")
        sandbox_trees = [await create_session(http, boxed["id"]) for _ in range(2)]
        plain_trees = [await create_session(http, plain["id"]) for _ in range(8)]

        async def turns_of(session: dict, n: int) -> None:
            for i in range(n):
                receipt = await post_input(http, session["id"], f"turn{i}")
                turn = await wait_turn_done(http, receipt["turn_id"], timeout=60)
                assert turn["status"] == "completed", await result_of(http, receipt["turn_id"])

        async def plain_turn(session: dict) -> None:
            await turns_of(session, 1)

        await asyncio.gather(*(turns_of(s, 4) for s in sandbox_trees),
                             *(plain_turn(s) for s in plain_trees))

        holders = {}
        for s in sandbox_trees:
            tree = s["tree_id"]
            holder = pg.scalar("SELECT host_id FROM yuxi.sandboxes WHERE tree_id = %s "
                               "AND status = 'active'", (tree,))
            holders[tree] = holder
            # Every run of the tree ran on the holder, each started once
            # (routed there by its queue, never handed over).
            assert {r["host_id"] for r in pg.rows(
                "SELECT host_id FROM yuxi.runs WHERE tree_id = %s", (tree,))} == {holder}
            assert pg.scalar("SELECT count(*) FROM yuxi.events WHERE tree_id = %s AND "
                             "type = 'run.moved'", (tree,)) == 0
            assert (workdir(dirs[holder], tree) / "turns.log").read_text().split() == [
                "turn0", "turn1", "turn2", "turn3"]
            other = next(h for h in dirs if h != holder)
            assert not workdir(dirs[other], tree).exists()
        # Trees without a sandbox ran on both hosts.
        plain_hosts = {r["host_id"] for r in pg.rows(
            "SELECT host_id FROM yuxi.runs WHERE tree_id = ANY(%s::uuid[])",
            ([s["tree_id"] for s in plain_trees],))}
        assert plain_hosts == {"host-a", "host-b"}

        # One group dies: its trees' next runs wait in its queue until its
        # heartbeat expired and the sweep released its sandboxes, then run on
        # the other group with a fresh generation (the workdir was on the
        # dead host's disk).
        moved = sandbox_trees[0]
        dead = holders[moved["tree_id"]]
        alive = next(h for h in dirs if h != dead)
        workers[dead].kill9()
        receipt = await post_input(http, moved["id"], "after")
        turn = await wait_turn_done(http, receipt["turn_id"], timeout=60)
        assert turn["status"] == "completed", await result_of(http, receipt["turn_id"])
        assert (await result_of(http, receipt["turn_id"]))["output"]["text"] == "lines: 1"
        box = pg.one("SELECT host_id, generation, status FROM yuxi.sandboxes WHERE tree_id = %s",
                     (moved["tree_id"],))
        assert box == {"host_id": alive, "generation": 2, "status": "active"}
        last_run = pg.scalar("SELECT host_id FROM yuxi.runs WHERE turn_id = %s",
                             (receipt["turn_id"],))
        assert last_run == alive
        assert (workdir(dirs[alive], moved["tree_id"]) / "turns.log").read_text() == "after\n"

        async def host_silent():
            return pg.scalar("SELECT silent_for > interval '3 seconds' FROM yuxi.hosts_v "
                             "WHERE host_id = %s", (dead,))
        await wait_for(host_silent, 10, "the dead host to show as silent")
