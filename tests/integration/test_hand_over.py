"""A released slot goes on in the releasing worker (issue 15): when a run's
completion gives a slot to another run of its tree (the tree's next pending
run, or the parent whose wait the completion satisfies), that run is leased to
the completing worker in the same transaction (run.started, no job) and the
worker goes on with it. Bounded per job like the session's next turn, only
for runs that may run on the worker's host, one run per completion, and as
durable as a job: a worker that dies right after the hand-over commit leaves
a leased run that lease expiry recovers. Each guard has its negative case."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from tests.integration.helpers import (
    events, executor, new_session, rewrite_function, rows, runs_with_status, say_agent, scalar,
    spy_model_calls)
from yuxi.services import runs, sandbox, sessions

CHILD = say_agent("kid did {{ input }}")


def waker() -> dict:
    """A parent that creates one child and waits for its input (the
    benchmark's wake scenario)."""
    return {"model": "replay", "tools": ["cooperation"], "replay": {
        "rules": [{"match": "^wake", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": "w", "task": "child"}}]},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 60}}]},
            {"say": "woke"},
        ]}],
        "default": [{"say": "child done"}]}}


async def _jobs(pool) -> list[str]:
    found = await rows(pool, "SELECT args->>'run_id' AS run_id FROM procrastinate.procrastinate_jobs "
                             "WHERE task_name = 'execute_run' ORDER BY id")
    return [r["run_id"] for r in found]


async def _child(pool, parent, name: str) -> uuid.UUID:
    """A child session of `parent` with one queued task; returns its run."""
    child = await scalar(pool, "SELECT yuxi.create_child_session_v1(%s, NULL, %s, NULL, NULL, "
                               "%s::jsonb, 'task ' || %s)",
                         (parent.id, name, __import__("json").dumps(CHILD), name))
    return await scalar(pool, "SELECT id FROM yuxi.runs WHERE session_id = %s", (child,))


async def _capacity(pool, tree_id, n: int) -> None:
    await scalar(pool, "UPDATE yuxi.trees SET slot_capacity = %s WHERE id = %s RETURNING id",
                 (n, tree_id))


async def _ready(pool, scope, content: str = "x", session=None):
    """A session (new unless given) whose input `content` made a ready run,
    its job due: (session, run)."""
    session = session or await new_session(pool, scope)
    await sessions.receive_input(pool, scope, session.id, content=content)
    (run_id,) = await runs_with_status(pool, "ready", session.tree_id)
    return session, run_id


async def _running_root(pool, scope, host: str | None = None, session=None):
    """The root's turn running (leased with `token`) in a tree of one slot."""
    session = session or await new_session(pool, scope)
    await _capacity(pool, session.tree_id, 1)
    session, run_id = await _ready(pool, scope, session=session)
    token = uuid.uuid4()
    assert await runs.start_run(pool, run_id, token, 60, host=host) is not None
    return session, run_id, token


async def _status(pool, run_id) -> str:
    return await scalar(pool, "SELECT status FROM yuxi.runs WHERE id = %s", (run_id,))


# ---------------------------------------------------------------- fan-out


async def test_a_released_slot_goes_on_in_the_releasing_worker(pool, checkpoint_pool, alice):
    scope = alice[1]
    root, root_run, token = await _running_root(pool, scope)
    kids = [await _child(pool, root, f"k{i}") for i in range(3)]
    assert [await _status(pool, k) for k in kids] == ["pending"] * 3
    next_token = uuid.uuid4()
    outcome, following = await runs.complete(pool, root_run, token, {"text": "r"},
                                             next_token=next_token, lease_seconds=60)
    # The root's slot went to the oldest pending child, leased to this worker.
    assert (outcome, following["id"]) == ("completed", kids[0])
    assert following["input_content"] == "task k0" and following["session_path"] == "/root/k0"
    assert await rows(pool, "SELECT status, lease_token FROM yuxi.runs WHERE id = %s",
                      (kids[0],)) == [{"status": "running", "lease_token": next_token}]
    assert await _jobs(pool) == [str(root_run)]
    started = [e for e in await events(pool, root.tree_id) if e["type"] == "run.started"]
    assert started[-1]["run_id"] == kids[0] and started[-1]["data"]["handed_over"] is True


async def test_a_handed_over_run_counts_toward_the_worker_that_goes_on(pool, checkpoint_pool,
                                                                       alice):
    # The run a worker goes on with is its load (runs.claimer), as the run it
    # completed was: least-loaded announcements (pick_claimer_v1) see it.
    scope = alice[1]
    root = await new_session(pool, scope)
    await _capacity(pool, root.tree_id, 1)
    _, root_run = await _ready(pool, scope, session=root)
    token = uuid.uuid4()
    assert await runs.start_run(pool, root_run, token, 60, claimer=4242) is not None
    kid = await _child(pool, root, "k0")
    outcome, following = await runs.complete(pool, root_run, token, {"text": "r"},
                                             next_token=uuid.uuid4(), lease_seconds=60)
    assert (outcome, following["id"]) == ("completed", kid)
    assert await rows(pool, "SELECT status, claimer FROM yuxi.runs WHERE id = %s",
                      (kid,)) == [{"status": "running", "claimer": 4242}]


async def test_the_worker_goes_on_slot_after_slot(pool, checkpoint_pool, alice):
    scope = alice[1]
    root = await new_session(pool, scope)
    await _capacity(pool, root.tree_id, 1)
    await sessions.receive_input(pool, scope, root.id, content="x")
    (root_run,) = await runs_with_status(pool, "ready")
    kids = [await _child(pool, root, f"k{i}") for i in range(3)]
    assert await executor(pool, checkpoint_pool).execute(root_run) == "completed"
    assert [await _status(pool, k) for k in kids] == ["completed"] * 3
    assert await _jobs(pool) == [str(root_run)]  # no job for any child
    started = [e for e in await events(pool, root.tree_id) if e["type"] == "run.started"]
    assert [e["data"].get("handed_over", False) for e in started] == [False, True, True, True]
    results = await rows(pool, "SELECT output->>'text' AS text FROM yuxi.runs "
                               "WHERE id = ANY(%s) ORDER BY slot_seq", (kids,))
    assert [r["text"] for r in results] == [f"kid did task k{i}" for i in range(3)]
    assert await scalar(pool, "SELECT count(*) FROM yuxi.slot_claims") == 0


async def test_without_an_offer_the_released_slot_gets_a_job(pool, checkpoint_pool, alice):
    # Negative: a completion that offers nothing (no next token: a worker at
    # its bound) gives the slot to the pending child with a job, as before.
    scope = alice[1]
    root, root_run, token = await _running_root(pool, scope)
    kid = await _child(pool, root, "k0")
    outcome, following = await runs.complete(pool, root_run, token, {"text": "r"})
    assert (outcome, following) == ("completed", None)
    assert await _status(pool, kid) == "ready"
    assert await _jobs(pool) == [str(root_run), str(kid)]


async def _four_kids_on_one_slot(pool, scope) -> list[uuid.UUID]:
    """Four children of a tree of one slot: the first ready, three pending."""
    root = await new_session(pool, scope)
    await _capacity(pool, root.tree_id, 1)
    return [await _child(pool, root, f"k{i}") for i in range(4)]


async def test_hand_over_is_bounded_per_job_while_the_process_is_full(
        pool, checkpoint_pool, alice):
    # One slot in the process, held by this chain: a queued job could be
    # waiting for it, so the bound applies.
    kids = await _four_kids_on_one_slot(pool, alice[1])
    assert await _status(pool, kids[0]) == "ready"
    assert await executor(pool, checkpoint_pool, continued_runs=1,
                          worker_concurrency=1).execute(kids[0]) == "completed"
    assert [await _status(pool, k) for k in kids] == ["completed", "completed", "ready",
                                                      "pending"]
    assert await _jobs(pool) == [str(kids[0]), str(kids[2])]  # the queue takes over


async def test_hand_over_goes_on_past_the_bound_while_the_process_has_a_free_slot(
        pool, checkpoint_pool, alice):
    # The same chain in a process with a free slot: going on keeps no job
    # waiting, so the slot goes from child to child without a break (a
    # fan-out's chain no longer stops after MAX_CONTINUED_RUNS runs).
    kids = await _four_kids_on_one_slot(pool, alice[1])
    assert await executor(pool, checkpoint_pool, continued_runs=1,
                          worker_concurrency=2).execute(kids[0]) == "completed"
    assert [await _status(pool, k) for k in kids] == ["completed"] * 4
    assert await _jobs(pool) == [str(kids[0])]  # no job for any later child


@pytest.mark.parametrize("told", ["before the run", "during its model call"])
async def test_a_stopping_worker_goes_on_with_no_run(pool, checkpoint_pool, alice,
                                                     monkeypatch, told):
    # Negative of the above: a stopping worker (free slots or not) takes on
    # nothing after the run it has: the next child gets a job, for another
    # worker, and this one can exit once its run ends. Whether to go on is
    # asked at the completion, not at the run's start: a SIGTERM while the
    # run is in flight counts too.
    from yuxi.runtime import graph as graph_module

    kids = await _four_kids_on_one_slot(pool, alice[1])
    worker = executor(pool, checkpoint_pool, worker_concurrency=2)
    if told == "before the run":
        worker.stop_claims()
    else:
        real = graph_module.call_chat_model

        def stop_meanwhile(*args, **kwargs):
            worker.stop_claims()
            return real(*args, **kwargs)

        monkeypatch.setattr(graph_module, "call_chat_model", stop_meanwhile)
    assert await worker.execute(kids[0]) == "completed"
    assert [await _status(pool, k) for k in kids] == ["completed", "ready", "pending",
                                                      "pending"]
    assert await _jobs(pool) == [str(kids[0]), str(kids[1])]


def fanner(n: int) -> dict:
    """A parent that creates `n` children in one step and waits for all
    their inputs (the benchmark's fan-out, small)."""
    return {"model": "replay", "tools": ["cooperation"], "replay": {
        "rules": [{"match": "^fan", "steps": [
            {"call": [{"tool": "create_session", "args": {"name": f"c{i}", "task": f"t{i}"}}
                      for i in range(n)]},
            {"call": [{"tool": "wait_inputs", "args": {
                "input_ids": "{{ results|map(attribute='input_id')|list }}", "timeout_s": 60}}]},
            {"say": "all done"},
        ]}],
        "default": [{"say": "did {{ input }}"}]}}


async def _waiting_kids(pool, root) -> list[uuid.UUID]:
    """Two children created while the root holds the tree's only slot: they
    are pending."""
    kids = [await _child(pool, root, f"k{i}") for i in range(2)]
    assert [await _status(pool, k) for k in kids] == ["pending"] * 2
    return kids


async def test_a_suspension_hands_its_slot_over(pool, checkpoint_pool, alice):
    scope = alice[1]
    root, root_run, token = await _running_root(pool, scope)
    kids = await _waiting_kids(pool, root)
    inputs = [await scalar(pool, "SELECT input_id FROM yuxi.turns t JOIN yuxi.runs r "
                                 "ON r.turn_id = t.id WHERE r.id = %s", (k,)) for k in kids]
    next_token = uuid.uuid4()
    outcome, following = await runs.suspend(pool, root_run, token, "inputs", inputs, {}, 60,
                                            next_token=next_token, lease_seconds=60)
    assert (outcome, following["id"]) == ("suspended", kids[0])
    assert await rows(pool, "SELECT status, lease_token FROM yuxi.runs WHERE id = %s",
                      (kids[0],)) == [{"status": "running", "lease_token": next_token}]
    assert [await _status(pool, k) for k in kids] == ["running", "pending"]
    assert await _jobs(pool) == [str(root_run)]  # no job for the child
    log = await events(pool, root.tree_id)
    tail = [(e["type"], e["run_id"]) for e in log[-3:]]
    # The root's suspension is told before the child's start.
    assert tail == [("run.suspended", root_run), ("turn.waiting", root_run),
                    ("run.started", kids[0])]
    assert log[-1]["data"]["handed_over"] is True


async def test_without_an_offer_a_suspension_gives_its_slot_a_job(pool, checkpoint_pool,
                                                                   alice):
    # Negative: no next token, no lease: the child gets a job, as before.
    scope = alice[1]
    root, root_run, token = await _running_root(pool, scope)
    kids = await _waiting_kids(pool, root)
    inputs = [await scalar(pool, "SELECT input_id FROM yuxi.turns t JOIN yuxi.runs r "
                                 "ON r.turn_id = t.id WHERE r.id = %s", (k,)) for k in kids]
    assert await runs.suspend(pool, root_run, token, "inputs", inputs, {}, 60) \
        == ("suspended", None)
    assert [await _status(pool, k) for k in kids] == ["ready", "pending"]
    assert await _jobs(pool) == [str(root_run), str(kids[0])]


async def test_a_wait_that_is_ready_hands_nothing_over(pool, checkpoint_pool, alice):
    # The offer is made only once the wait is stored and the slot released:
    # a 'ready' outcome keeps the slot and leases nothing.
    scope = alice[1]
    root, root_run, token = await _running_root(pool, scope)
    kids = await _waiting_kids(pool, root)
    assert await runs.suspend(pool, root_run, token, "inputs", [], {}, 60,
                              next_token=uuid.uuid4(), lease_seconds=60) == ("ready", None)
    assert await _status(pool, root_run) == "running"
    assert [await _status(pool, k) for k in kids] == ["pending"] * 2


async def test_a_fan_out_runs_in_its_roots_job(pool, checkpoint_pool, alice):
    # A tree of one slot: the root creates three children and waits; its
    # suspension hands the slot to the first child, each child's completion
    # to the next, and the last one's wakes the root. One job for all.
    scope = alice[1]
    root = await new_session(pool, scope, fanner(3))
    await _capacity(pool, root.tree_id, 1)
    receipt = await sessions.receive_input(pool, scope, root.id, content="fan")
    (root_run,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(root_run) == "completed"
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "all done")
    assert await _jobs(pool) == [str(root_run)]
    started = [e["data"].get("handed_over", False) for e in await events(pool, root.tree_id)
               if e["type"] == "run.started"]
    assert started == [False, True, True, True, True]


async def test_without_going_on_a_fan_out_root_leaves_its_slot_to_a_job(
        pool, checkpoint_pool, alice):
    # Negative of the above: a worker that may not go on suspends the root
    # and the first child gets a job.
    scope = alice[1]
    root = await new_session(pool, scope, fanner(3))
    await _capacity(pool, root.tree_id, 1)
    await sessions.receive_input(pool, scope, root.id, content="fan")
    (root_run,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(root_run) \
        == "suspended"
    (first_child,) = await runs_with_status(pool, "ready")
    assert await _jobs(pool) == [str(root_run), str(first_child)]


async def test_one_completion_hands_over_one_run(pool, checkpoint_pool, alice):
    # Two slots freed at once (the capacity was raised while children
    # waited): one child is leased to the worker, the other gets a job.
    scope = alice[1]
    root, root_run, token = await _running_root(pool, scope)
    kids = [await _child(pool, root, f"k{i}") for i in range(2)]
    await _capacity(pool, root.tree_id, 2)
    next_token = uuid.uuid4()
    _, following = await runs.complete(pool, root_run, token, {"text": "r"},
                                       next_token=next_token, lease_seconds=60)
    assert following["id"] == kids[0]
    assert [await _status(pool, k) for k in kids] == ["running", "ready"]
    assert await _jobs(pool) == [str(root_run), str(kids[1])]


async def test_without_taking_the_offer_once_two_runs_would_share_a_lease(
        pool, checkpoint_pool, alice):
    # Negative: an offer that stays open after it was taken leases every run
    # the completion gives a slot to with the same token.
    await rewrite_function(pool, "yuxi.take_hand_over_v1",
                           "PERFORM set_config('yuxi.hand_over_token', '', true);", "")
    scope = alice[1]
    root, root_run, token = await _running_root(pool, scope)
    kids = [await _child(pool, root, f"k{i}") for i in range(2)]
    await _capacity(pool, root.tree_id, 2)
    next_token = uuid.uuid4()
    await runs.complete(pool, root_run, token, {"text": "r"}, next_token=next_token,
                        lease_seconds=60)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs WHERE lease_token = %s",
                        (next_token,)) == 2


# ------------------------------------------------------------------- wake


async def _suspended_waker(pool, checkpoint_pool, scope):
    """A parent suspended on its one child's input; returns (parent, its
    receipt, the child's ready run)."""
    parent = await new_session(pool, scope, waker())
    receipt = await sessions.receive_input(pool, scope, parent.id, content="wake")
    (first,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(first) == "suspended"
    (child_run,) = await runs_with_status(pool, "ready")
    return parent, receipt, first, child_run


async def test_a_run_recovered_between_its_wait_and_the_suspension_waits(
        pool, checkpoint_pool, alice, monkeypatch):
    # The parent's wait tool saved its interrupt, then the worker died before
    # the suspension committed. The recovered run has no resume payload: it
    # must wait for the child (suspend), never answer the wait at once.
    scope = alice[1]
    parent = await new_session(pool, scope, waker())
    receipt = await sessions.receive_input(pool, scope, parent.id, content="wake")
    (first,) = await runs_with_status(pool, "ready")
    original = runs.suspend

    async def dies(*args, **kwargs):
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(runs, "suspend", dies)
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(first) \
        == "infra_fault"
    monkeypatch.setattr(runs, "suspend", original)
    (child_run,) = await runs_with_status(pool, "ready")  # created before the wait
    assert await runs.recover_expired(pool, max_attempts=3) == [first]
    retry = next(r for r in await runs_with_status(pool, "ready") if r != child_run)
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(retry) \
        == "suspended"
    assert (await sessions.get_turn(pool, scope, receipt.turn_id)).status == "waiting"
    assert await executor(pool, checkpoint_pool).execute(child_run) == "completed"
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "woke")


async def test_the_child_worker_goes_on_with_the_woken_parent(pool, checkpoint_pool, alice):
    scope = alice[1]
    parent, receipt, first, child_run = await _suspended_waker(pool, checkpoint_pool, scope)
    assert await executor(pool, checkpoint_pool).execute(child_run) == "completed"
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "woke")
    # The parent's resume run never had a job: its run.started commits with
    # the child's turn.completed.
    assert await _jobs(pool) == [str(first), str(child_run)]
    log = await events(pool, parent.tree_id)
    done = next(e for e in log if e["type"] == "turn.completed"
                and e["session_id"] != parent.id)
    resumed = [e for e in log if e["type"] == "run.started" and e["session_id"] == parent.id][-1]
    assert resumed["data"]["handed_over"] is True
    assert done["seq"] < resumed["seq"]
    assert await scalar(pool, "SELECT xmin::text FROM yuxi.events WHERE tree_id = %s "
                              "AND seq = %s", (parent.tree_id, done["seq"])) == \
        await scalar(pool, "SELECT xmin::text FROM yuxi.events WHERE tree_id = %s AND seq = %s",
                     (parent.tree_id, resumed["seq"]))


async def test_without_hand_over_the_woken_parent_gets_a_job(pool, checkpoint_pool, alice):
    # Negative: a worker that may not go on leaves the parent's resume run to
    # the queue.
    scope = alice[1]
    parent, receipt, first, child_run = await _suspended_waker(pool, checkpoint_pool, scope)
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(child_run) \
        == "completed"
    (resume,) = await runs_with_status(pool, "ready")
    assert await scalar(pool, "SELECT session_id FROM yuxi.runs WHERE id = %s",
                        (resume,)) == parent.id
    assert await _jobs(pool) == [str(first), str(child_run), str(resume)]


async def test_a_worker_that_dies_after_the_hand_over_commit_loses_nothing(
        pool, checkpoint_pool, alice):
    # The child's completion commits the parent's resume run leased to the
    # worker, which dies before executing it (kill -9 right after the
    # commit): the lease expires, recovery makes a retry with a job, and the
    # parent's turn ends as if nothing had happened.
    scope = alice[1]
    parent, receipt, first, child_run = await _suspended_waker(pool, checkpoint_pool, scope)
    token, next_token = uuid.uuid4(), uuid.uuid4()
    assert await runs.start_run(pool, child_run, token, 60) is not None
    outcome, following = await runs.complete(pool, child_run, token, {"text": "child done"},
                                             next_token=next_token, lease_seconds=60)
    assert outcome == "completed" and following["session_id"] == parent.id
    assert following["resume"]["reason"] == "satisfied"
    assert await _jobs(pool) == [str(first), str(child_run)]
    # ... the worker is gone. Its lease runs out.
    await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = clock_timestamp() - "
                       "interval '1 s' WHERE id = %s RETURNING id", (following["id"],))
    (retry,) = await runs.recover_expired(pool, max_attempts=3)
    assert retry == following["id"]
    (ready,) = await runs_with_status(pool, "ready")
    assert await _jobs(pool) == [str(first), str(child_run), str(ready)]
    assert await executor(pool, checkpoint_pool).execute(ready) == "completed"
    result = await sessions.get_result(pool, scope, receipt.turn_id)
    assert (result.status, result.output["text"]) == ("completed", "woke")


# ---------------------------------------------------------- host affinity


async def _tree_with_sandbox_on(pool, scope, tmp_path, host: str):
    """A root whose tree's sandbox is live on `host` (its run completed)."""
    session = await new_session(pool, scope)
    await sessions.receive_input(pool, scope, session.id, content="box")
    (run_id,) = await runs_with_status(pool, "ready", session.tree_id)
    token = uuid.uuid4()
    run = await runs.start_run(pool, run_id, token, 60, host=host)
    await sandbox.claim(pool, tmp_path, run["id"], token, run["tree_id"], host=host)
    await runs.complete(pool, run["id"], token, {"text": "done"})
    return session


async def _complete_on(pool, scope, session, host: str):
    """The root's next turn, run on `host`, completes while a child waits
    for the tree's one slot; returns (the child's run, what came back)."""
    _, root_run, token = await _running_root(pool, scope, host=host, session=session)
    kid = await _child(pool, session, "k")
    _, following = await runs.complete(pool, root_run, token, {"text": "r"},
                                       next_token=uuid.uuid4(), lease_seconds=60)
    return kid, following


async def test_a_run_pinned_to_another_host_is_not_handed_over(pool, alice, tmp_path):
    scope = alice[1]
    session = await _tree_with_sandbox_on(pool, scope, tmp_path, "host-a")
    # A run of the tree that reached host-b (deferred before the sandbox went
    # live there) completes: the child must go to host-a's queue.
    kid, following = await _complete_on(pool, scope, session, "host-b")
    assert following is None
    assert await _status(pool, kid) == "ready"
    assert await rows(pool, "SELECT queue_name FROM procrastinate.procrastinate_jobs "
                            "WHERE args->>'run_id' = %s", (str(kid),)) == [
        {"queue_name": "runs@host-a"}]


async def test_a_run_of_the_sandbox_host_is_handed_over_there(pool, alice, tmp_path):
    scope = alice[1]
    session = await _tree_with_sandbox_on(pool, scope, tmp_path, "host-a")
    kid, following = await _complete_on(pool, scope, session, "host-a")
    assert following["id"] == kid
    assert await scalar(pool, "SELECT host_id FROM yuxi.runs WHERE id = %s", (kid,)) == "host-a"


async def test_without_the_host_check_a_pinned_run_would_be_handed_over(
        pool, alice, tmp_path):
    # Negative: the host affinity check removed from the offer.
    await rewrite_function(pool, "yuxi.take_hand_over_v1",
                           "IF v_queue <> 'runs'", "IF false AND v_queue <> 'runs'")
    scope = alice[1]
    session = await _tree_with_sandbox_on(pool, scope, tmp_path, "host-a")
    kid, following = await _complete_on(pool, scope, session, "host-b")
    assert following["id"] == kid


# ----------------------------------------------------- the conversation


async def test_a_run_of_another_session_reads_its_own_conversation(pool, checkpoint_pool,
                                                                   alice, monkeypatch):
    # The worker keeps a completed turn's conversation for the session's next
    # turn (no read of the archive); a run of another session handed over by
    # the same completion must not get it: the child's conversation holds
    # its own turns only.
    from yuxi.services import conversation

    scope = alice[1]
    seen = spy_model_calls(monkeypatch)
    root = await new_session(pool, scope)
    await _capacity(pool, root.tree_id, 1)
    kid_run = await _child(pool, root, "k0")
    assert await executor(pool, checkpoint_pool).execute(kid_run) == "completed"
    kid = await scalar(pool, "SELECT session_id FROM yuxi.runs WHERE id = %s", (kid_run,))
    await sessions.receive_input(pool, scope, root.id, content="root work")
    (root_run,) = await runs_with_status(pool, "ready", root.tree_id)
    await sessions.receive_input(pool, scope, kid, content="again", mode="queue")
    (kid_again,) = await runs_with_status(pool, "pending", root.tree_id)
    assert await executor(pool, checkpoint_pool).execute(root_run) == "completed"
    assert await _status(pool, kid_again) == "completed"
    started = [e for e in await events(pool, root.tree_id) if e["type"] == "run.started"]
    assert started[-1]["run_id"] == kid_again and started[-1]["data"]["handed_over"] is True
    # The kid's model saw its own conversation, never the root's.
    assert seen[-1] == ["task k0", "kid did task k0", "again"], seen
    kept = await conversation.messages(checkpoint_pool, kid)
    assert [(m["role"], m["content"]) for m in kept] == [
        ("human", "task k0"), ("ai", "kid did task k0"),
        ("human", "again"), ("ai", "kid did again")]


# ----------------------------------------------------- balance across workers


async def _busy(pool, scope, claimer: int, n: int) -> None:
    """`n` runs of other trees running on `claimer`'s worker."""
    for _ in range(n):
        _session, run_id = await _ready(pool, scope)
        assert await runs.start_run(pool, run_id, uuid.uuid4(), 60, claimer=claimer)


async def _next_of_a_worker_running(db_url, pool, scope, mine: int, peers: int):
    """A worker (claimer `a`) completes a tree's run while it runs `mine`
    other runs and its peer (claimer `b`) runs `peers`: what the tree's
    next run became, and both claimers."""
    async with await psycopg.AsyncConnection.connect(
            db_url, autocommit=True, application_name="yuxi-claims localhost") as a, \
            await psycopg.AsyncConnection.connect(
                db_url, autocommit=True, application_name="yuxi-claims localhost") as b:
        a_pid, b_pid = a.info.backend_pid, b.info.backend_pid
        root = await new_session(pool, scope)
        await _capacity(pool, root.tree_id, 1)
        _, root_run = await _ready(pool, scope, session=root)
        token = uuid.uuid4()
        assert await runs.start_run(pool, root_run, token, 60, claimer=a_pid)
        kid = await _child(pool, root, "k0")
        await _busy(pool, scope, a_pid, mine)
        await _busy(pool, scope, b_pid, peers)
        _, following = await runs.complete(pool, root_run, token, {"text": "r"},
                                           next_token=uuid.uuid4(), lease_seconds=60)
        (kid_row,) = await rows(pool, "SELECT status, claimer FROM yuxi.runs WHERE id = %s",
                                (kid,))
        return following, kid_row, a_pid, b_pid


async def test_a_worker_running_more_than_its_peer_lets_the_next_run_go(db_url, pool, alice):
    # Two other runs here, none on the peer: the tree's next run is
    # announced to the peer instead of going on here (chains one worker
    # took while alone spread out).
    following, kid, _a, b = await _next_of_a_worker_running(db_url, pool, alice[1], 2, 0)
    assert following is None and kid == {"status": "ready", "claimer": b}


async def test_a_balanced_worker_goes_on_with_the_next_run(db_url, pool, alice):
    # Negative cases: one other run (a balanced fan-out's two chains per
    # worker: no check at all), or a peer as busy: it goes on.
    for mine, peers in ((1, 0), (2, 2)):
        following, kid, a, _b = await _next_of_a_worker_running(db_url, pool, alice[1],
                                                                mine, peers)
        assert following is not None and kid == {"status": "running", "claimer": a}


# ------------------------------------------- a queued run in place of one


async def _job_of(pool, run_id) -> int:
    return await scalar(pool, "SELECT id FROM procrastinate.procrastinate_jobs "
                              "WHERE args->>'run_id' = %s", (str(run_id),))


async def _go_on(pool, run_id, token) -> dict | None:
    """Complete a run offering to go on (as a worker with room does): the
    run it goes on with, or None."""
    _, following = await runs.complete(pool, run_id, token, {"text": "r"},
                                       next_token=uuid.uuid4(), lease_seconds=60)
    return following


async def _claimed_root(pool, scope, host: str | None = None):
    """The root's turn claimed as a claimer (on `host`) does, its job removed
    with the lease: no job of its own is left in the queue."""
    session, run_id = await _ready(pool, scope)
    token = uuid.uuid4()
    assert await runs.start_run(pool, run_id, token, 60, job_id=await _job_of(pool, run_id),
                                host=host) is not None
    return session, run_id, token


async def _update_job(pool, run_id, assignment: str) -> None:
    """Change a run's job (`assignment`: SQL), as Procrastinate's triggers
    expect it: under its search_path."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SET LOCAL search_path = procrastinate, pg_catalog")
        cur = await conn.execute(f"UPDATE procrastinate_jobs SET {assignment} "
                                 "WHERE args->>'run_id' = %s", (str(run_id),))
        assert cur.rowcount == 1


async def _drop_job(pool, run_id) -> None:
    await scalar(pool, "SELECT yuxi.drop_run_job_v1(id, %s) FROM procrastinate.procrastinate_jobs "
                       "WHERE args->>'run_id' = %s", (run_id, str(run_id)))


async def _ready_root(pool, scope) -> uuid.UUID:
    """A root's ready run for an executor to execute, its job removed as
    the claim that gives it to a worker would have."""
    _session, run_id = await _ready(pool, scope)
    await _drop_job(pool, run_id)
    return run_id


async def _queued(pool, scope, n: int) -> list[tuple]:
    """`n` sessions of their own trees, each with a ready run whose job is
    due (no claimer listens in these tests): [(session, run)], oldest first."""
    return [await _ready(pool, scope, "queued") for _ in range(n)]


async def test_a_completion_that_hands_nothing_over_takes_the_oldest_queued_run(
        pool, checkpoint_pool, alice):
    # Nothing of the root's tree waits for its slot: instead of leaving the
    # worker's place to Procrastinate's next fetch, the completion leases
    # the oldest ready run of the queue to the worker and drops its job.
    scope = alice[1]
    _root, root_run, token = await _claimed_root(pool, scope)
    (s1, q1), (_s2, q2) = await _queued(pool, scope, 2)
    next_token = uuid.uuid4()
    outcome, following = await runs.complete(pool, root_run, token, {"text": "r"},
                                             next_token=next_token, lease_seconds=60)
    assert (outcome, following["id"]) == ("completed", q1)
    assert following["session_id"] == s1.id and following["input_content"] == "queued"
    assert await rows(pool, "SELECT status, lease_token FROM yuxi.runs WHERE id = %s",
                      (q1,)) == [{"status": "running", "lease_token": next_token}]
    assert await _jobs(pool) == [str(q2)]
    (started,) = [e for e in await events(pool, s1.tree_id) if e["type"] == "run.started"]
    assert started["run_id"] == q1 and started["data"]["from_queue"] is True


async def test_without_an_offer_a_completion_takes_no_queued_run(pool, checkpoint_pool, alice):
    # Negative: a worker that does not go on (at its bound) leaves the
    # queued run to its job.
    scope = alice[1]
    _root, root_run, token = await _claimed_root(pool, scope)
    ((_s1, q1),) = await _queued(pool, scope, 1)
    assert await runs.complete(pool, root_run, token, {"text": "r"}) == ("completed", None)
    assert await _status(pool, q1) == "ready" and await _jobs(pool) == [str(q1)]


async def test_a_run_of_the_tree_goes_before_a_queued_one(pool, checkpoint_pool, alice):
    scope = alice[1]
    root, root_run, token = await _running_root(pool, scope)
    kid = await _child(pool, root, "k0")
    ((_s1, q1),) = await _queued(pool, scope, 1)
    following = await _go_on(pool, root_run, token)
    assert following["id"] == kid and await _status(pool, q1) == "ready"


async def test_a_suspension_that_hands_nothing_over_takes_a_queued_run(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    parent = await new_session(pool, scope, waker())
    await sessions.receive_input(pool, scope, parent.id, content="wake")
    (first,) = await runs_with_status(pool, "ready", parent.tree_id)
    ((s1, q1),) = await _queued(pool, scope, 1)
    # As a claim would have (the executor is given the run alone).
    await _drop_job(pool, first)
    # The parent creates its child (whose run gets a slot and a job in that
    # step) and suspends on it: its suspension, the first transaction of
    # this job to offer, hands nothing of its tree over and takes q1, the
    # oldest queued run; without it, the job would end there.
    await executor(pool, checkpoint_pool).execute(first)
    assert await _status(pool, q1) == "completed"
    (started,) = [e for e in await events(pool, s1.tree_id) if e["type"] == "run.started"]
    assert started["data"]["from_queue"] is True


async def test_a_stopping_worker_takes_no_queued_run(pool, checkpoint_pool, alice):
    # Queued runs have jobs that the other workers fetch: one that is
    # stopping leaves them (and goes on with no run of its own tree either).
    scope = alice[1]
    root_run = await _ready_root(pool, scope)
    ((_s1, q1),) = await _queued(pool, scope, 1)
    worker = executor(pool, checkpoint_pool)
    worker.stop_claims()
    assert await worker.execute(root_run) == "completed"
    assert await _status(pool, q1) == "ready" and await _jobs(pool) == [str(q1)]
    # Negative: a worker that is not stopping takes it.
    other_run = await _ready_root(pool, scope)
    assert await executor(pool, checkpoint_pool).execute(other_run) == "completed"
    assert await _status(pool, q1) == "completed"


async def _completion_with_the_oldest_not_due(pool, scope):
    """Two queued runs, the older one's job due later (announced to a
    claimer): what a completion went on with, and both runs."""
    _root, root_run, token = await _claimed_root(pool, scope)
    (_s1, q1), (_s2, q2) = await _queued(pool, scope, 2)
    await _update_job(pool, q1, "scheduled_at = now() + interval '1 hour'")
    return await _go_on(pool, root_run, token), q1, q2


async def test_a_job_not_yet_due_is_left_to_its_claimer(pool, checkpoint_pool, alice):
    # A run announced to a claimer has its job due 20 ms later: that claimer
    # may still take it; the completion takes the next due one.
    following, q1, q2 = await _completion_with_the_oldest_not_due(pool, alice[1])
    assert following["id"] == q2 and await _status(pool, q1) == "ready"


async def test_without_the_due_check_a_claimer_s_run_would_be_taken(
        pool, checkpoint_pool, alice):
    await rewrite_function(pool, "yuxi.take_queued_run_v1",
                           "(q.scheduled_at IS NULL OR q.scheduled_at <= now())", "true")
    following, q1, _q2 = await _completion_with_the_oldest_not_due(pool, alice[1])
    assert following["id"] == q1


async def test_a_queued_run_of_another_host_stays(pool, checkpoint_pool, alice):
    scope = alice[1]
    for host, taken in ((None, False), ("host-b", False), ("host-a", True)):
        _root, root_run, token = await _claimed_root(pool, scope, host)
        ((_s1, q1),) = await _queued(pool, scope, 1)
        await _update_job(pool, q1, "queue_name = 'runs@host-a'")
        following = await _go_on(pool, root_run, token)
        assert (following is not None) == taken, host
        assert await _status(pool, q1) == ("running" if taken else "ready")
        if not taken:  # out of the next round's way
            await _drop_job(pool, q1)


async def _complete_while_held(db_url, pool, scope, hold: str, timeout: float = 10.0):
    """Complete a claimed root (with an offer) while another connection
    holds a lock of the one queued run (`hold`: a statement locking it,
    given the run's tree and job): what came back, and the queued run."""
    _root, root_run, token = await _claimed_root(pool, scope)
    ((session, q1),) = await _queued(pool, scope, 1)
    job = await _job_of(pool, q1)
    async with await psycopg.AsyncConnection.connect(db_url) as other:
        await other.execute(hold, {"tree": session.tree_id, "job": job})
        try:
            following = await asyncio.wait_for(_go_on(pool, root_run, token), timeout)
        finally:
            await other.rollback()
    return following, q1


HOLD_TREE = "SELECT 1 FROM yuxi.trees WHERE id = %(tree)s FOR UPDATE"
HOLD_JOB = "SELECT 1 FROM procrastinate.procrastinate_jobs WHERE id = %(job)s FOR UPDATE"


async def test_a_queued_run_whose_tree_or_job_is_busy_is_skipped_without_waiting(
        db_url, pool, alice):
    # Another tree's lock, taken while this transaction holds its own, is
    # outside the lock order; a job row locked is a fetch in flight. Either
    # is skipped: the completion neither waits nor deadlocks (a wait here
    # would last until the other connection's rollback, after the timeout).
    for hold in (HOLD_TREE, HOLD_JOB):
        following, q1 = await _complete_while_held(db_url, pool, alice[1], hold)
        assert following is None, hold
        assert await _status(pool, q1) == "ready" and str(q1) in await _jobs(pool)
        await _drop_job(pool, q1)  # out of the next round's way


async def test_without_skip_locked_the_completion_would_wait_for_the_other_tree(
        db_url, pool, alice):
    await rewrite_function(pool, "yuxi.take_queued_run_v1",
                           "WHERE id = v_tree FOR UPDATE SKIP LOCKED",
                           "WHERE id = v_tree FOR UPDATE")
    with pytest.raises(TimeoutError):
        await _complete_while_held(db_url, pool, alice[1], HOLD_TREE, timeout=1.0)


async def test_without_skip_locked_the_completion_would_wait_for_the_job(db_url, pool, alice):
    await rewrite_function(pool, "yuxi.take_queued_run_v1",
                           "AND j.status = 'todo'\n       FOR UPDATE SKIP LOCKED",
                           "AND j.status = 'todo'\n       FOR UPDATE")
    with pytest.raises(TimeoutError):
        await _complete_while_held(db_url, pool, alice[1], HOLD_JOB, timeout=1.0)


async def _stale_job_completion(pool, scope):
    """Another worker's run, leased without its job's removal (the job
    stays: the oldest due one), while a claimed root completes with an
    offer: (the other run, its token, what the completion went on with)."""
    _other, other_run, other_token = await _running_root(pool, scope)
    _root, root_run, token = await _claimed_root(pool, scope)
    following = await _go_on(pool, root_run, token)
    return other_run, other_token, following


async def test_a_stale_job_s_run_is_not_taken_again(pool, checkpoint_pool, alice):
    # A job whose run is not ready any more is left to its fetch (a no-op):
    # a running run is never leased a second time.
    other_run, other_token, following = await _stale_job_completion(pool, alice[1])
    assert following is None
    assert await scalar(pool, "SELECT lease_token FROM yuxi.runs WHERE id = %s",
                        (other_run,)) == other_token
    assert await _jobs(pool) == [str(other_run)]


async def test_without_the_ready_checks_a_running_run_would_be_leased_again(
        pool, checkpoint_pool, alice):
    # Both: the read before the other tree's lock, and the lease's under it.
    await rewrite_function(pool, "yuxi.take_queued_run_v1",
                           "WHERE id = v_run AND status = 'ready';", "WHERE id = v_run;")
    await rewrite_function(pool, "yuxi.take_queued_run_v1",
                           "yuxi.lease_run_v1(v_run, 'ready',",
                           "yuxi.lease_run_v1(v_run, (SELECT status FROM yuxi.runs "
                           "WHERE id = v_run),")
    other_run, other_token, following = await _stale_job_completion(pool, alice[1])
    assert following["id"] == other_run
    assert await scalar(pool, "SELECT lease_token FROM yuxi.runs WHERE id = %s",
                        (other_run,)) != other_token


async def test_a_claim_after_the_take_finds_the_run_taken(pool, checkpoint_pool, alice):
    # The claimer the run was announced to claims it after the completion
    # took it: nothing (its claim is a no-op), and the other way round the
    # completion finds the claimed run's job gone and takes the next one.
    scope = alice[1]
    _root, root_run, token = await _claimed_root(pool, scope)
    (_s1, q1), (_s2, q2), (_s3, q3) = await _queued(pool, scope, 3)
    q1_job, q2_job = await _job_of(pool, q1), await _job_of(pool, q2)
    # q1 claimed first: the completion takes q2 (and deletes its job).
    assert await runs.start_run(pool, q1, uuid.uuid4(), 60, job_id=q1_job) is not None
    following = await _go_on(pool, root_run, token)
    assert following["id"] == q2
    assert await _jobs(pool) == [str(q3)]
    # q2's claimer comes late: no lease, and q3 is untouched.
    assert await runs.start_run(pool, q2, uuid.uuid4(), 60, job_id=q2_job) is None
    assert await _jobs(pool) == [str(q3)]


async def test_the_worker_goes_on_with_queued_runs_in_one_job(pool, checkpoint_pool, alice):
    # The executor's loop: each completion takes the next queued run, each
    # of another session, which reads its own conversation.
    scope = alice[1]
    root_run = await _ready_root(pool, scope)
    queued = await _queued(pool, scope, 3)
    assert await executor(pool, checkpoint_pool).execute(root_run) == "completed"
    for _s, q in queued:
        assert await _status(pool, q) == "completed"
        assert await scalar(pool, "SELECT output->>'text' FROM yuxi.runs WHERE id = %s",
                            (q,)) == "echo: queued"
    assert await _jobs(pool) == []


async def test_a_worker_that_dies_after_taking_a_queued_run_loses_nothing(
        pool, checkpoint_pool, alice):
    scope = alice[1]
    _root, root_run, token = await _claimed_root(pool, scope)
    ((_s1, q1),) = await _queued(pool, scope, 1)
    following = await _go_on(pool, root_run, token)
    assert following["id"] == q1 and await _jobs(pool) == []
    # ... the worker is gone: its lease runs out, recovery gives a retry a job.
    await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = clock_timestamp() - "
                       "interval '1 s' WHERE id = %s RETURNING id", (q1,))
    (retry,) = await runs.recover_expired(pool, max_attempts=3)
    assert retry == q1
    (ready,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool, continued_runs=0).execute(ready) == "completed"
    turn = await scalar(pool, "SELECT turn_id FROM yuxi.runs WHERE id = %s", (ready,))
    result = await sessions.get_result(pool, scope, turn)
    assert (result.status, result.output["text"]) == ("completed", "echo: queued")
