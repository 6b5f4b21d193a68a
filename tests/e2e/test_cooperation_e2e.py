"""The cooperation acceptance scenario with the real API and a real worker:
a root session fans out to six children whose steps take 500 ms; the tree
never has more than 4 slot holders (sampled from PostgreSQL), the parent
waits without a slot, the fifth and sixth children queue and run, and the
parent resumes in the same turn with a new run and reports every child's
exact result."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.helpers import client, post_input, result_of, session_with_script, wait_turn_done

pytestmark = pytest.mark.e2e

CHILDREN = 6


def fan_out_script() -> dict:
    create = [{"tool": "create_session", "args": {"name": f"c{i}", "task": f"task {i}"}}
              for i in range(CHILDREN)]
    fetch = [{"tool": "get_result", "args": {"input_id": f"{{{{ results[{i}].input_id }}}}"}}
             for i in range(CHILDREN)]
    return {
        "rules": [{"match": "^fan out", "steps": [
            {"call": create},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 120}}]},
            {"call": fetch},
            {"say": "{{ results[%d:]|map(attribute='output')|map(attribute='text')|join(' | ') }}"
                    % (CHILDREN + 1)},
        ]}],
        "default": [{"say": "result of {{ input }} by {{ session.path }}", "delay_ms": 500}],
    }


async def test_fan_out_to_six_children_shares_four_slots(api, worker, alice, pg):
    key, _ = alice
    async with client(api, key) as http:
        root = await session_with_script(http, fan_out_script(), tools=["cooperation"])
        receipt = await post_input(http, root["id"], "fan out")
        tree = root["tree_id"]
        samples: list[dict] = []

        async def sample() -> None:
            while True:
                samples.append(pg.one(
                    """SELECT (SELECT count(*) FROM yuxi.slot_claims WHERE tree_id = %(t)s) AS held,
                              (SELECT count(*) FROM yuxi.runs WHERE tree_id = %(t)s
                                 AND status = 'pending') AS pending,
                              (SELECT status FROM yuxi.turns WHERE id = %(turn)s) AS parent,
                              (SELECT count(*) FROM yuxi.slot_claims c JOIN yuxi.runs r
                                 ON r.id = c.run_id WHERE r.turn_id = %(turn)s) AS parent_slots""",
                    {"t": tree, "turn": receipt["turn_id"]}))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        try:
            turn = await wait_turn_done(http, receipt["turn_id"], timeout=60)
        finally:
            sampler.cancel()
        result = await result_of(http, receipt["turn_id"])

    assert turn["status"] == "completed", result
    assert result["output"]["text"] == " | ".join(
        f"result of task {i} by /root/c{i}" for i in range(CHILDREN))
    assert max(s["held"] for s in samples) <= 4
    assert max(s["held"] for s in samples) == 4  # the tree did use its four slots
    # The fifth and sixth children queued for a slot.
    assert max(s["pending"] for s in samples) >= 2
    # While the parent waited it held no slot.
    waiting = [s for s in samples if s["parent"] == "waiting"]
    assert waiting and all(s["parent_slots"] == 0 for s in waiting)
    # Same turn, a new run: suspended then completed.
    assert [r["status"] for r in turn["runs"]] == ["suspended", "completed"]
    children = pg.rows("SELECT path, parent_id::text FROM yuxi.sessions WHERE parent_id IS NOT NULL "
                       "ORDER BY path")
    assert children == [{"path": f"/root/c{i}", "parent_id": root["id"]} for i in range(CHILDREN)]
