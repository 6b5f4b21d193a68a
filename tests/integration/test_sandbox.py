"""Tree sandboxes: claims, idle release under the per-tree advisory lock
(the releaser never runs while a run of the tree is active; a claim racing a
release gets a fresh generation), with an injectable clock."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
import psycopg
import pytest

from tests.integration.helpers import (
    new_session, runs_with_status, scalar, rewrite_function, rewrite_function_sync,
)
from tests.integration.test_config import wait_until_blocked
from yuxi.services import runs, sandbox, sessions

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(minutes: float):
    return lambda: T0 + dt.timedelta(minutes=minutes)


async def _run_with_sandbox(pool, scope, tmp_path, minute=0):
    session = await new_session(pool, scope)
    await sessions.receive_input(pool, scope, session.id, content="x")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    run = await runs.start_run(pool, run_id, token, 60)
    box = await sandbox.claim(pool, tmp_path, run_id, token, run["tree_id"], now=at(minute))
    return run, token, box


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, box, pids):
        self.calls.append((box.generation, pids))
        sandbox.release_files_and_processes(box, pids)


async def test_idle_release_keeps_the_workdir_and_reprovisions(pool, alice, tmp_path):
    run, token, box = await _run_with_sandbox(pool, alice[1], tmp_path)
    (box.workdir / "kept.txt").write_text("stays")
    (box.tmp / "scratch").write_text("goes")
    await runs.complete(pool, run["id"], token, {"text": "done"})
    releaser = Recorder()
    assert await sandbox.release_idle(pool, tmp_path, now=at(4.9), releaser=releaser) == []
    assert await sandbox.release_idle(pool, tmp_path, now=at(5.1), releaser=releaser) == [run["tree_id"]]
    assert releaser.calls == [(1, [])]
    assert (box.workdir / "kept.txt").read_text() == "stays"
    assert not box.tmp.exists()
    # The next run of the tree gets a fresh generation.
    await sessions.receive_input(pool, alice[1], run["session_id"], content="again")
    (nxt,) = await runs_with_status(pool, "ready")
    token2 = uuid.uuid4()
    await runs.start_run(pool, nxt, token2, 60)
    fresh = await sandbox.claim(pool, tmp_path, nxt, token2, run["tree_id"], now=at(6))
    assert fresh.generation == 2 and fresh.tmp.exists() and not (fresh.tmp / "scratch").exists()


async def test_the_releaser_is_never_called_while_a_run_is_active(pool, alice, tmp_path):
    run, token, box = await _run_with_sandbox(pool, alice[1], tmp_path)
    releaser = Recorder()
    # Idle by the clock, but the run still executes.
    assert await sandbox.release_idle(pool, tmp_path, now=at(60), releaser=releaser) == []
    assert releaser.calls == [] and box.tmp.exists()


async def test_without_the_active_run_check_the_releaser_would_run(pool, alice, tmp_path):
    # Negative case: drop the active-run condition from the idle decision.
    await rewrite_function(pool, "yuxi.begin_sandbox_release_v1",
                           "OR EXISTS (SELECT 1 FROM yuxi.runs WHERE tree_id = p_tree",
                           "OR false AND EXISTS (SELECT 1 FROM yuxi.runs WHERE tree_id = p_tree")
    run, token, box = await _run_with_sandbox(pool, alice[1], tmp_path)
    releaser = Recorder()
    assert await sandbox.release_idle(pool, tmp_path, now=at(60), releaser=releaser) != []
    assert releaser.calls  # it would have deleted a sandbox in use


async def _claim_racing_release(pool, scope, tmp_path, db_url, postgresql) -> int:
    """Connection 1 decides a release (no run active) and, holding the
    sandbox lock, is deleting; meanwhile a new run starts and claims the
    sandbox on connection 2. Returns the generation the claim got."""
    run, token, box = await _run_with_sandbox(pool, scope, tmp_path)
    await runs.complete(pool, run["id"], token, {"text": "done"})
    with psycopg.connect(db_url) as c1, psycopg.connect(db_url) as c2:
        gen = c1.execute("SELECT yuxi.begin_sandbox_release_v1(%s, %s, interval '5 minutes')",
                         (run["tree_id"], T0 + dt.timedelta(minutes=10))).fetchone()[0]
        assert gen == 1
        # A new run of the tree starts after the decision.
        await sessions.receive_input(pool, scope, run["session_id"], content="again")
        (nxt,) = await runs_with_status(pool, "ready")
        token2 = uuid.uuid4()
        await runs.start_run(pool, nxt, token2, 60)
        with ThreadPoolExecutor(1) as ex:
            claim = ex.submit(lambda: c2.execute(
                "SELECT yuxi.claim_sandbox_v1(%s, %s, %s)",
                (nxt, token2, T0 + dt.timedelta(minutes=10))).fetchone()[0])
            wait_until_blocked(postgresql, c2.info.backend_pid)
            sandbox.release_files_and_processes(box, [])  # the releaser, under the lock
            c1.commit()
            generation = claim.result(timeout=10)
        c2.commit()
    return generation


async def test_a_claim_racing_a_release_gets_a_fresh_generation(
        pool, alice, tmp_path, db_url, postgresql):
    assert await _claim_racing_release(pool, alice[1], tmp_path, db_url, postgresql) == 2


async def test_without_the_lock_the_claim_keeps_the_half_deleted_sandbox(
        pool, alice, tmp_path, db_url, postgresql):
    # Negative case: a claim that does not take the sandbox lock reads the
    # generation being deleted and keeps using it.
    rewrite_function_sync(postgresql, "yuxi.claim_sandbox_v1",
                          "PERFORM pg_advisory_xact_lock(yuxi.lock_key_v1('sandbox:' || v_tree));", "")
    postgresql.commit()
    assert await _claim_racing_release(pool, alice[1], tmp_path, db_url, postgresql) == 1


async def _tool_context(pool, scope, tmp_path, mode="bwrap"):
    from tests.integration.test_permissions import _grant_all  # noqa: F401
    from yuxi.runtime import confine
    from yuxi.runtime.tools import ToolContext
    from yuxi.services import resources
    from yuxi.settings import Settings
    await resources.create(pool, scope.app_id, "tool_group:sandbox")
    await resources.grant(pool, scope, "tool_group:sandbox")
    run, token, box = await _run_with_sandbox(pool, scope, tmp_path)
    box = msgspec.structs.replace(box, jail=confine.for_settings(Settings(sandbox=mode)))
    return ToolContext(pool=pool, run_id=run["id"], token=token, call_id="c", run=run,
                       sandbox=box), box


@pytest.mark.parametrize("mode", ["bwrap", "host"])
async def test_run_command_output_timeout_and_files(pool, alice, tmp_path, mode):
    from yuxi.runtime import sandbox_tools
    ctx, box = await _tool_context(pool, alice[1], tmp_path, mode)
    out = await sandbox_tools.run_command(ctx, {"command": "for i in 1 2 3; do echo line$i; "
                                                           "sleep 0.05; done; pwd; echo $TMPDIR"})
    # Confined, the workdir and temp area are /workspace and /tmp inside.
    inside = ["/workspace", "/tmp"] if mode == "bwrap" else [str(box.workdir), str(box.tmp)]
    assert out["output"].split() == ["line1", "line2", "line3", *inside]
    assert out["exit_code"] == 0 and not out["timed_out"]
    big = await sandbox_tools.run_command(ctx, {"command": "head -c 200000 /dev/zero | tr '\\\\0' x"})
    assert big["truncated"] and len(big["output"]) == sandbox_tools.MAX_OUTPUT
    slow = await sandbox_tools.run_command(ctx, {"command": "sleep 30", "timeout_s": 0.6})
    assert slow["timed_out"] and slow["exit_code"] != 0
    await sandbox_tools.write_file(ctx, {"path": "a/b.txt", "content": "hi"})
    assert (await sandbox_tools.read_file(ctx, {"path": "a/b.txt"}))["content"] == "hi"
    assert (await sandbox_tools.list_files(ctx, {"path": "a"}))["files"] == ["a/b.txt"]


async def test_side_effecting_sandbox_tools_recheck_the_grant(pool, alice, tmp_path):
    from yuxi.errors import PermissionDenied
    from yuxi.runtime import sandbox_tools
    from yuxi.services import resources
    ctx, box = await _tool_context(pool, alice[1], tmp_path)
    await resources.revoke(pool, alice[1], "tool_group:sandbox")
    with pytest.raises(PermissionDenied):
        await sandbox_tools.write_file(ctx, {"path": "x.txt", "content": "no"})
    assert not (box.workdir / "x.txt").exists()


async def _member_context(pool, ctx, tmp_path):
    """A second member of ctx's tree (a child of its session) with a running
    run holding the same sandbox."""
    from yuxi.runtime.tools import ToolContext
    await scalar(pool, "SELECT yuxi.create_child_session_v1(%s, %s, 'member', NULL, NULL, "
                       "'{}', 'task')", (ctx.run["session_id"], ctx.run_id))
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    run = await runs.start_run(pool, run_id, token, 60)
    box = msgspec.structs.replace(
        await sandbox.claim(pool, tmp_path, run_id, token, run["tree_id"], now=at(0)),
        jail=ctx.sandbox.jail)  # the same worker's
    return ToolContext(pool=pool, run_id=run_id, token=token, call_id="m", run=run, sandbox=box)


def _wait_for_go(name: str) -> str:
    """A command that says it started, waits for the file `go` in the
    workdir, then leaves its mark: only a command still alive marks."""
    return f"touch started-{name}; while [ ! -e go ]; do sleep 0.02; done; touch done-{name}"


async def _cancel_one_of_two_commands(pool, scope, tmp_path):
    """The turn's command and another member's run side by side in the tree's
    sandbox; the turn is cancelled, then `go` lets a surviving command end.
    Returns both results, the marks left in the workdir and the sandbox."""
    import asyncio
    from yuxi.runtime import sandbox_tools
    ctx, box = await _tool_context(pool, scope, tmp_path)
    member = await _member_context(pool, ctx, tmp_path)
    assert member.sandbox == box  # one sandbox for the tree
    (box.tmp / "shared").write_text("others use this")
    own = asyncio.create_task(sandbox_tools.run_command(ctx, {"command": _wait_for_go("own")}))
    other = asyncio.create_task(sandbox_tools.run_command(member, {"command": _wait_for_go("member")}))
    for _ in range(500):  # both commands are running
        if all((box.workdir / f"started-{n}").exists() for n in ("own", "member")):
            break
        await asyncio.sleep(0.01)
    assert (await sessions.cancel_turn(pool, scope, ctx.run["turn_id"])).status == "running"
    own_out = await asyncio.wait_for(own, 5)
    # A command stopped by the cancel ends within one intent poll (0.5 s)
    # of it, without `go`; then `go` lets a surviving one end.
    await asyncio.wait({other}, timeout=1.5)
    (box.workdir / "go").touch()
    other_out = await asyncio.wait_for(other, 5)
    marks = sorted(p.name for p in box.workdir.glob("done-*"))
    return own_out, other_out, marks, box


async def test_cancel_stops_only_the_turns_own_command(pool, alice, tmp_path):
    # Guard: run_command stops on its own turn's cancel intent
    # (runs.cancel_requested of ctx.run's turn, the `cancel_requested`
    # query) and kills only its own process group; the cancel leaves the
    # sandbox alone. Another member's command in the same sandbox goes on.
    own, other, marks, box = await _cancel_one_of_two_commands(pool, alice[1], tmp_path)
    assert own["cancelled"] and not own["timed_out"]
    assert not other["cancelled"] and other["exit_code"] == 0
    assert marks == ["done-member"]  # the member's command lived on; the turn's did not
    # The sandbox itself stays for the other members.
    assert (box.tmp / "shared").read_text() == "others use this"
    assert await scalar(pool, "SELECT status FROM yuxi.sandboxes") == "active"


async def test_without_the_turns_own_intent_a_members_command_is_stopped(
        pool, alice, tmp_path, monkeypatch):
    # Negative case: the intent check no longer keyed by the command's own
    # turn (it reads any turn of the tree): the member's command, whose turn
    # nobody cancelled, is stopped too.
    from yuxi import db
    old = "FROM yuxi.turns WHERE id = %(turn_id)s"
    assert old in db.QUERIES["cancel_requested"]
    monkeypatch.setitem(db.QUERIES, "cancel_requested", db.QUERIES["cancel_requested"].replace(
        old, "FROM yuxi.turns WHERE tree_id = (SELECT tree_id FROM yuxi.turns "
             "WHERE id = %(turn_id)s) ORDER BY cancel_requested_at IS NULL LIMIT 1"))
    own, other, marks, _ = await _cancel_one_of_two_commands(pool, alice[1], tmp_path)
    assert own["cancelled"] and other["cancelled"]
    assert marks == []


def _process_group_leader() -> "subprocess.Popen":
    import subprocess
    return subprocess.Popen(["sleep", "300"], start_new_session=True)


async def test_the_release_kills_the_recorded_process_group(pool, alice, tmp_path):
    run, token, box = await _run_with_sandbox(pool, alice[1], tmp_path)
    proc = _process_group_leader()
    try:
        identity = sandbox.process_identity(proc.pid)
        assert identity is not None
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO yuxi.sandbox_processes (tree_id, generation, pid, identity, run_id,"
                " command) VALUES (%s, %s, %s, %s, %s, 'sleep 300')",
                (run["tree_id"], box.generation, proc.pid, identity, run["id"]))
        await runs.complete(pool, run["id"], token, {"text": "done"})
        assert await sandbox.release_idle(pool, tmp_path, now=at(6)) == [run["tree_id"]]
        assert proc.wait(timeout=10) == -9
    finally:
        proc.kill()


async def test_the_release_spares_a_process_that_reused_a_recorded_pid(pool, alice, tmp_path):
    # The recorded process ended and its pid now belongs to another one (its
    # start time differs): killing that pid's group would hit a stranger.
    run, token, box = await _run_with_sandbox(pool, alice[1], tmp_path)
    stranger = _process_group_leader()
    try:
        boot = sandbox.process_identity(stranger.pid).split(":")[0]
        sandbox.release_files_and_processes(box, [(stranger.pid, f"{boot}:1")])
        assert stranger.poll() is None
        # The same call with the process's own identity kills it.
        sandbox.release_files_and_processes(box, [(stranger.pid,
                                                   sandbox.process_identity(stranger.pid))])
        assert stranger.wait(timeout=10) == -9
    finally:
        stranger.kill()


async def test_the_release_kills_a_group_whose_leader_has_exited(pool, alice, tmp_path):
    # The leader started a member and exited: the group lives on with the
    # member, and its id (the leader's pid) cannot go to a new process
    # meanwhile, so the release still kills it.
    import subprocess
    run, token, box = await _run_with_sandbox(pool, alice[1], tmp_path)
    leader = subprocess.Popen(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
                              stdout=subprocess.PIPE, start_new_session=True)
    identity = sandbox.process_identity(leader.pid) or ""
    member = int(leader.stdout.read().strip())
    leader.stdout.close()
    leader.wait()
    try:
        assert sandbox.process_identity(leader.pid) is None
        assert os.getpgid(member) == leader.pid
        sandbox.release_files_and_processes(box, [(leader.pid, identity)])
        for _ in range(200):
            if sandbox.process_identity(member) is None:
                break
            await asyncio.sleep(0.01)
        assert sandbox.process_identity(member) is None
    finally:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_an_ended_process_has_no_identity():
    proc = _process_group_leader()
    proc.kill()
    proc.wait()
    assert sandbox.process_identity(proc.pid) is None
