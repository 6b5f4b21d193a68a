"""A ready run is announced on `yuxi_ready` with its job (defer_run_job_v1),
and a worker with a free slot claims it: the lease and the removal of the
job still in the queue commit together (claim_run_v1), so Procrastinate
never hands that job out. A job fetched first stays and finds its run taken."""

from __future__ import annotations

import asyncio
import json
import uuid

import psycopg
import pytest

from tests.e2e.helpers import wait_for
from tests.integration.helpers import (
    executor, new_session, rewrite_function, rows, runs_with_status, scalar)
from yuxi.services import runs, sessions

JOB = "SELECT status::text FROM procrastinate.procrastinate_jobs WHERE id = %s"


async def _announced(db_url, pool, scope, woken: list[str] | None = None,
                     ) -> tuple[str, uuid.UUID, int, object]:
    """An input to an idle session, and what `yuxi_ready` said of its run;
    `woken` gets the channels of what Procrastinate's workers were sent
    (their LISTEN on any queue) by the same commit."""
    session = await new_session(pool, scope)
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as listener:
        await listener.execute("LISTEN yuxi_ready")
        await listener.execute("LISTEN procrastinate_any_queue_v1")
        receipt = await sessions.receive_input(pool, scope, session.id, content="q")
        # One commit's notifications arrive in the order they were sent:
        # the job's (its insert's trigger) before `yuxi_ready`.
        notes = []
        async for note in listener.notifies(timeout=5):
            notes.append(note)
            if note.channel == "yuxi_ready":
                break
    if woken is not None:
        woken.extend(n.channel for n in notes if n.channel != "yuxi_ready")
    queue, run, job, announced_session, _claimer = note.payload.split()
    (ready,) = await runs_with_status(pool, "ready")
    assert uuid.UUID(run) == ready and uuid.UUID(announced_session) == session.id
    return queue, ready, int(job), receipt


async def test_a_claimed_run_takes_its_job_out_of_the_queue(db_url, pool, checkpoint_pool,
                                                            alice):
    queue, run, job, receipt = await _announced(db_url, pool, alice[1])
    assert queue == "runs" and await scalar(pool, JOB, (job,)) == "todo"
    ex = executor(pool, checkpoint_pool)
    assert await ex.execute(run, job_id=job) == "completed"
    assert await scalar(pool, JOB, (job,)) is None
    assert (await sessions.get_turn(pool, alice[1], receipt.turn_id)).status == "completed"
    # The job fetched anyway (it was not: a late duplicate) finds nothing to do.
    assert await ex.execute(run) == "skipped"


async def test_without_the_job_removal_the_job_stays_queued(db_url, pool, checkpoint_pool,
                                                            alice):
    # Negative case: a claim that leaves the job queued lets Procrastinate
    # hand it out again (to be skipped: one more fetch and task per run).
    await rewrite_function(pool, "yuxi.claim_run_v1",
                           "PERFORM yuxi.drop_run_job_v1(p_job, p_run);", "NULL;")
    _queue, run, job, _receipt = await _announced(db_url, pool, alice[1])
    assert await executor(pool, checkpoint_pool).execute(run, job_id=job) == "completed"
    assert await scalar(pool, JOB, (job,)) == "todo"


async def test_a_job_fetched_first_stays_and_finds_its_run_taken(db_url, pool, checkpoint_pool,
                                                                 alice):
    _queue, run, job, _receipt = await _announced(db_url, pool, alice[1])
    # A worker fetched the job meanwhile (Procrastinate's triggers name its
    # tables unqualified).
    async with await psycopg.AsyncConnection.connect(
            db_url, autocommit=True, options="-c search_path=procrastinate") as conn:
        await conn.execute("UPDATE procrastinate_jobs SET status = 'doing' WHERE id = %s",
                           (job,))
    ex = executor(pool, checkpoint_pool)
    assert await ex.execute(run, job_id=job) == "completed"
    assert await scalar(pool, JOB, (job,)) == "doing"
    assert await ex.execute(run) == "skipped"  # the fetched job's task


async def test_a_claim_comes_second_to_the_job(db_url, pool, checkpoint_pool, alice):
    _queue, run, job, _receipt = await _announced(db_url, pool, alice[1])
    ex = executor(pool, checkpoint_pool)
    assert await ex.execute(run) == "completed"  # the job's task took the run first
    assert await ex.execute(run, job_id=job) == "skipped"


async def test_a_worker_claims_only_its_queues_and_only_with_a_free_slot(
        db_url, pool, checkpoint_pool, alice):
    ex = executor(pool, checkpoint_pool, worker_concurrency=1)
    ex.claims(("runs",))
    try:
        assert await ex.listener.ready()
        on_ready = ex.listener.on_ready
        run, job, session = uuid.uuid4(), 1, uuid.uuid4()
        on_ready("runs@elsewhere %s %d %s 0" % (run, job, session))  # another host's queue
        on_ready("garbage")  # not a payload of ours
        assert not ex._claims
        async with ex.slots:  # the process is busy
            on_ready("runs %s %d %s 0" % (run, job, session))
            assert not ex._claims
        on_ready("runs %s %d %s %d" % (run, job, session, ex.listener.pid + 1))  # another's
        assert not ex._claims
        on_ready("runs %s %d %s 0" % (run, job, session))  # no such run: claimed, then skipped
        assert len(ex._claims) == 1
        await asyncio.gather(*ex._claims)
        # A burst beyond the free slots: the claims that find no slot when
        # they start give up (their jobs are there) instead of waiting.
        for _ in range(5):
            on_ready("runs %s %d %s 0" % (uuid.uuid4(), job, session))
        pending = list(ex._claims)
        assert len(pending) == 5
        async with ex.slots:  # taken before any of them starts
            await asyncio.wait_for(asyncio.gather(*pending), 5)
    finally:
        await ex.close_claims()
    assert ex.listener.on_ready is None and not ex._claims
    # The listener claims what is deferred: the turn completes with no job run.
    ex2 = executor(pool, checkpoint_pool)
    ex2.claims(("runs",))
    try:
        assert await ex2.listener.ready()
        session = await new_session(pool, alice[1])
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
            await conn.execute("LISTEN yuxi_turns")  # the turn's end
            receipt = await sessions.receive_input(pool, alice[1], session.id, content="q")
            async for _note in conn.notifies(timeout=10):
                turn = await sessions.get_turn(pool, alice[1], receipt.turn_id)
                if turn.status == "completed":
                    break
        assert (await sessions.get_turn(pool, alice[1], receipt.turn_id)).status == "completed"
        assert await scalar(pool, "SELECT count(*) FROM procrastinate.procrastinate_jobs "
                                  "WHERE task_name = 'execute_run'") == 0
    finally:
        await ex2.close_claims()


async def _claim_while_fetched(db_url, run: uuid.UUID, job: int) -> uuid.UUID | None:
    """Claim the run while another connection holds its job's row (as
    Procrastinate's fetch does while it takes the job); a claim that would
    wait for that lock fails after 500 ms instead of hanging."""
    async with await psycopg.AsyncConnection.connect(db_url) as fetcher:
        await fetcher.execute("SELECT id FROM procrastinate.procrastinate_jobs WHERE id = %s "
                              "FOR UPDATE", (job,))
        try:
            async with await psycopg.AsyncConnection.connect(db_url) as claimer:
                await claimer.execute("SET lock_timeout = '500ms'")
                cur = await claimer.execute(
                    "SELECT id FROM yuxi.claim_run_v1(%s, %s, %s, 30, false, NULL, NULL)",
                    (run, job, uuid.uuid4()))
                (claimed,) = await cur.fetchone()
                await claimer.commit()
                return claimed
        finally:
            await fetcher.rollback()


async def test_a_claim_does_not_wait_for_a_fetch_in_flight(db_url, pool, alice):
    # Procrastinate's fetch, woken by the same commit, may hold the job's row
    # while the claim commits: the claim takes the run without waiting, and
    # leaves the job to the fetch (whose task finds the run taken).
    _queue, run, job, _receipt = await _announced(db_url, pool, alice[1])
    assert await _claim_while_fetched(db_url, run, job) == run
    assert await scalar(pool, JOB, (job,)) == "todo"


async def test_without_skip_locked_a_claim_waits_for_the_fetch(db_url, pool, alice):
    # Negative case: a plain DELETE waits for the fetch's lock.
    await rewrite_function(pool, "yuxi.drop_run_job_v1", "FOR UPDATE SKIP LOCKED", "")
    _queue, run, job, _receipt = await _announced(db_url, pool, alice[1])
    with pytest.raises(psycopg.errors.LockNotAvailable):
        await _claim_while_fetched(db_url, run, job)


async def _claim_attempts(db_url, pool, checkpoint_pool, scope, turns: int) -> dict[str, int]:
    """Two claiming workers, `turns` inputs to idle sessions: how many claims
    each run got (every turn must complete through the claims)."""
    workers = [executor(pool, checkpoint_pool) for _ in range(2)]
    attempts: dict[str, int] = {}
    for ex in workers:
        claimed = ex._claimed

        async def counted(run_id, job_id, session_id, claimed=claimed):
            attempts[str(run_id)] = attempts.get(str(run_id), 0) + 1
            await claimed(run_id, job_id, session_id)

        ex._claimed = counted
        ex.claims(("runs",))
    try:
        for ex in workers:
            assert await ex.listener.ready()
        deadline = asyncio.get_running_loop().time() + 10
        assert await scalar(pool, "SELECT count(*) FROM yuxi.claimers_v1()") == 2
        receipts = []
        for _ in range(turns):
            session = await new_session(pool, scope)
            receipts.append(await sessions.receive_input(pool, scope, session.id, content="q"))
        for receipt in receipts:
            while (await sessions.get_turn(pool, scope, receipt.turn_id)).status != "completed":
                assert asyncio.get_running_loop().time() < deadline + 20, "a turn never ran"
                await asyncio.sleep(0.02)
    finally:
        for ex in workers:
            await ex.close_claims()
    return attempts


async def test_of_two_claiming_workers_one_claims_each_run(db_url, pool, checkpoint_pool,
                                                          alice):
    attempts = await _claim_attempts(db_url, pool, checkpoint_pool, alice[1], 8)
    assert sorted(attempts.values()) == [1] * 8


async def test_without_a_preferred_claimer_both_claim_every_run(
        db_url, pool, checkpoint_pool, alice, monkeypatch):
    # Negative case: every claiming worker claims; all but one lose the race
    # for the lease (a round trip and a wake-up each, at every turn's start).
    from yuxi.runtime.live import WorkerListener

    monkeypatch.setattr(WorkerListener, "picked", lambda self, claimer: True)
    attempts = await _claim_attempts(db_url, pool, checkpoint_pool, alice[1], 8)
    assert sorted(attempts.values()) == [2] * 8


SCHEDULED = """SELECT scheduled_at IS NOT NULL
                 AND scheduled_at > now() AND scheduled_at < now() + interval '1 s'
                 FROM procrastinate.procrastinate_jobs WHERE id = %s"""


async def test_while_a_claimer_listens_a_ready_run_s_job_waits_for_it(
        db_url, pool, checkpoint_pool, alice):
    # Procrastinate's fetch, woken by the same commit, would race the claim
    # for the job: while a claimer of the queue listens, the job is due a
    # moment later (what its claimer leaves is fetched then).
    ex = executor(pool, checkpoint_pool, worker_concurrency=1)
    ex.claims(("runs",))
    try:
        assert await ex.listener.ready()
        async with ex.slots:  # busy: it leaves the run to its job
            woken: list[str] = []
            _queue, run, job, _receipt = await _announced(db_url, pool, alice[1], woken)
            assert await scalar(pool, SCHEDULED, (job,)) is True
            # A job due later wakes no fetch (it would find nothing): the
            # workers' polling finds it once it is due.
            assert woken == []
    finally:
        await ex.close_claims()


async def test_with_no_claimer_listening_the_job_is_due_at_once(db_url, pool, alice):
    # Negative case (YUXI_WORKER_CLAIMS=0, or no worker up): nothing would
    # claim the run, so its job is not held back, and it wakes the workers'
    # fetch at once.
    woken: list[str] = []
    _queue, run, job, _receipt = await _announced(db_url, pool, alice[1], woken)
    assert await scalar(pool, "SELECT scheduled_at FROM procrastinate.procrastinate_jobs "
                              "WHERE id = %s", (job,)) is None
    assert woken == ["procrastinate_any_queue_v1"]


async def test_the_claimers_of_a_host_queue_are_that_host_s(db_url, pool, checkpoint_pool,
                                                           alice):
    # A claimer serves `runs` and its own host's queue: a run of another
    # host's queue has no claimer here (its job is due at once), and no
    # worker of this host is picked for it.
    ex = executor(pool, checkpoint_pool, host_id="h1")
    ex.claims(("runs", "runs@h1"))
    pick = "SELECT yuxi.pick_claimer_v1(%s, gen_random_uuid())"
    try:
        assert await ex.listener.ready()
        pid = ex.listener.pid
        assert ex.listener.claimer == pid
        for queue, picked in (("runs", pid), ("runs@h1", pid), ("runs@h2", None)):
            assert await scalar(pool, pick, (queue,)) == picked, queue
    finally:
        await ex.close_claims()
    assert ex.listener.claimer is None
    # Once its old connection is gone (closed as the listener stops claiming).
    deadline = asyncio.get_running_loop().time() + 5
    while await scalar(pool, pick, ("runs",)):
        assert asyncio.get_running_loop().time() < deadline, "the claimer stayed listed"
        await asyncio.sleep(0.02)


# ------------------------------------------------- the least-loaded claimer

CLAIMED = """SELECT claimer, count(*) AS runs FROM yuxi.runs
              WHERE status IN ('ready', 'running') AND id = ANY(%s) GROUP BY claimer"""


async def _fake_claimer(db_url) -> psycopg.AsyncConnection:
    """A connection listed as a claimer of this host (it claims nothing)."""
    return await psycopg.AsyncConnection.connect(
        db_url, autocommit=True, application_name="yuxi-claims localhost")


async def _ready_runs(pool, scope, n: int) -> list[uuid.UUID]:
    """`n` ready runs of idle sessions, announced to nobody, their jobs gone
    (as a lost job leaves them: redeliver_ready_runs_v1 announces them
    again, all in one transaction)."""
    made = []
    for _ in range(n):
        session = await new_session(pool, scope)
        await sessions.receive_input(pool, scope, session.id, content="q")
        made.append(await scalar(pool, "SELECT id FROM yuxi.runs WHERE session_id = %s",
                                 (session.id,)))
    await scalar(pool, "SELECT count(yuxi.drop_run_job_v1(id, (args->>'run_id')::uuid)) "
                       "FROM procrastinate.procrastinate_jobs "
                       "WHERE args->>'run_id' = ANY(%s::text[])", ([str(r) for r in made],))
    return made


async def _announce_again(pool) -> None:
    await scalar(pool, "SELECT count(*) FROM yuxi.redeliver_ready_runs_v1('0 s')")


async def _spread(db_url, pool, scope) -> tuple[int, int, dict[int, int]]:
    """Two claimers: `a` has 10 runs announced to it (alone then), then 12
    runs are announced in one transaction with `b` listening too. Returns
    the claimers and how the 12 were spread."""
    first, second = await _ready_runs(pool, scope, 10), await _ready_runs(pool, scope, 12)
    a = await _fake_claimer(db_url)
    try:
        # (The 12 look younger than the sweep's horizon for now.)
        await scalar(pool, "UPDATE yuxi.runs SET created_at = now() + interval '1 h' "
                           "WHERE id = ANY(%s) RETURNING 1", (second,))
        await _announce_again(pool)  # the first 10, to `a` alone
        assert await rows(pool, CLAIMED, (first,)) == [{"claimer": a.info.backend_pid,
                                                        "runs": 10}]
        await scalar(pool, "UPDATE yuxi.runs SET created_at = now() - interval '1 h' "
                           "WHERE id = ANY(%s) RETURNING 1", (second,))
        b = await _fake_claimer(db_url)
        try:
            await _announce_again(pool)  # the 12, in one transaction
            spread = {r["claimer"]: r["runs"] for r in await rows(pool, CLAIMED, (second,))}
            return a.info.backend_pid, b.info.backend_pid, spread
        finally:
            await b.close()
    finally:
        await a.close()


async def test_a_ready_run_is_announced_to_the_least_loaded_claimer(db_url, pool, alice):
    # `b` takes runs until it has as many as `a` (10: each announcement in
    # the transaction counts the ones before it); the tie then goes either
    # way, and the last run to whichever has fewer: 11 to `b`, 1 to `a`.
    a, b, spread = await _spread(db_url, pool, alice[1])
    assert spread == {b: 11, a: 1}


async def test_without_the_load_the_claimers_split_runs_by_hash(db_url, pool, alice):
    # Negative case: ordered by the hash alone, the 12 runs split about
    # evenly however loaded `a` is (all 11 or 12 to `b`: a 13-in-4096 chance).
    await rewrite_function(pool, "yuxi.pick_claimer_v1", "ORDER BY yuxi.claimer_load_v1(c.pid)",
                           "ORDER BY 0 * yuxi.claimer_load_v1(c.pid)")
    a, b, spread = await _spread(db_url, pool, alice[1])
    assert sum(spread.values()) == 12 and spread.get(b, 0) < 11


async def test_a_run_counts_toward_the_worker_that_leases_it(db_url, pool, checkpoint_pool,
                                                            alice):
    # The lease records the leasing worker's claimer: a claiming worker's
    # running runs are its load, whoever the run was announced to.
    (run,) = await _ready_runs(pool, alice[1], 1)  # announced to nobody
    ex = executor(pool, checkpoint_pool)
    ex.claims(("runs",))
    try:
        assert await ex.listener.ready()
        token = uuid.uuid4()
        assert await runs.start_run(pool, run, token, 30, claimer=ex.listener.claimer)
        assert await scalar(pool, "SELECT claimer FROM yuxi.runs WHERE id = %s",
                            (run,)) == ex.listener.pid
    finally:
        await ex.close_claims()
    # A worker that does not claim records none.
    (run,) = await _ready_runs(pool, alice[1], 1)
    assert ex.listener.claimer is None
    assert await executor(pool, checkpoint_pool).execute(run) == "completed"
    assert await scalar(pool, "SELECT claimer FROM yuxi.runs WHERE id = %s", (run,)) is None


LISTENERS = """SELECT count(*) FROM pg_stat_activity
                WHERE datname = current_database() AND pid <> pg_backend_pid()
                  AND query ILIKE 'LISTEN%%'"""


async def assert_no_listeners(pool) -> None:
    """No connection listens any more. A closed connection's backend leaves
    pg_stat_activity a moment after the client's close returns (the server
    ends it asynchronously), so this waits for that; a connection left open
    stays listed and fails."""
    async def none_listens() -> bool:
        return await scalar(pool, LISTENERS) == 0
    await wait_for(none_listens, 5, "no LISTEN connection")


async def test_closed_claims_leave_no_listening_connection(pool, checkpoint_pool):
    # A worker that stops claiming with no turn watched keeps no LISTEN
    # connection: one made again at once outlived the worker (a test's
    # database could not be dropped while it connected).
    ex = executor(pool, checkpoint_pool)
    ex.claims(("runs",))
    assert await ex.listener.ready()
    assert await scalar(pool, LISTENERS) == 1
    await ex.close_claims()
    await assert_no_listeners(pool)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.claimers_v1()") == 0


async def test_closed_claims_keep_listening_for_a_watched_turn_s_cancel(pool, checkpoint_pool):
    # Negative case: a real model's call in flight still hears its turn's
    # cancel, on a connection made again without the claims.
    ex = executor(pool, checkpoint_pool)
    ex.claims(("runs",))
    assert await ex.listener.ready()
    with ex.listener.watch(uuid.uuid4()):
        await ex.close_claims()
        assert await ex.listener.ready()

        async def one_listener_no_claimer() -> bool:  # the claims' backend gone
            return (await scalar(pool, LISTENERS) == 1
                    and await scalar(pool, "SELECT count(*) FROM yuxi.claimers_v1()") == 0)
        await wait_for(one_listener_no_claimer, 5, "one listener, not a claimer")
    await asyncio.gather(ex.listener.stop_claiming(), return_exceptions=True)


async def test_procrastinate_s_jobs_are_heard_on_the_claims_connection(pool, checkpoint_pool):
    # One LISTEN connection per worker process: Procrastinate's worker hears
    # its jobs on the executor's listener (workers.app.WorkerConnector). Its
    # channels come after the listener connected: it is made again with them.
    ex = executor(pool, checkpoint_pool)
    ex.claims(("runs",))
    heard: list[tuple[str, str]] = []
    got = asyncio.Event()

    async def on_notification(*, channel: str, payload: str) -> None:
        heard.append((channel, payload))
        got.set()

    relay = None
    try:
        assert await ex.listener.ready()
        first = ex.listener.pid
        relay = asyncio.create_task(ex.listener.relay(
            ["procrastinate_queue_v1#runs", "procrastinate_queue_v1#runs@h1"], on_notification))
        await asyncio.sleep(0)
        assert await ex.listener.ready()
        assert ex.listener.pid != first  # listening again, with the relay's channels
        assert await scalar(pool, LISTENERS) == 1
        job = await scalar(pool, "SELECT yuxi.defer_job_v1('runs@h1', 'execute_run', "
                                 "'{}'::jsonb, now())")
        await asyncio.wait_for(got.wait(), 5)
        assert heard[0][0] == "procrastinate_queue_v1#runs@h1"
        assert json.loads(heard[0][1]) == {"type": "job_inserted", "job_id": job}
        # A relay cancelled passes nothing more (the connection still
        # listens on its channels until it is made again).
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        got.clear()
        await scalar(pool, "SELECT yuxi.defer_job_v1('runs@h1', 'execute_run', "
                           "'{}'::jsonb, now())")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(got.wait(), 0.5)
        assert len(heard) == 1
    finally:
        if relay is not None:
            relay.cancel()
        await ex.close_claims()
    await assert_no_listeners(pool)
