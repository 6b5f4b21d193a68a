"""The conversation of earlier turns lives in yuxi.conversation, the
checkpoint holds one turn (sql/140_conversation.sql): every way a turn ends
leaves the same conversation as when the checkpoint held it all, the model
sees the whole of it, a crash between the archive and the checkpoint's reset
loses and duplicates nothing, bytes written per turn stay flat, and
GET /api/sessions/{id}/messages pages by keyset (O(page)).

Real database, the worker's real executor, the real Litestar app in-process."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from litestar.testing import AsyncTestClient

from tests.integration.helpers import (
    drain, executor, fenced_saver, new_session, rewrite_function, rows, runs_with_status,
    say_agent, scalar, spy_model_calls,
)
from yuxi.errors import LeaseLost
from yuxi.runtime import cleanup, executor as executor_module
from yuxi.services import conversation, runs, sessions

ECHO_TWICE = {"model": "replay", "tools": ["echo"], "replay": {"default": [
    {"call": [{"tool": "echo", "args": {"text": "t-{{ input }}"}}]}, {"say": "a-{{ input }}"}]}}


async def _turn(pool, checkpoint_pool, scope, session, content, expect="completed"):
    receipt = await sessions.receive_input(pool, scope, session.id, content=content)
    assert await drain(pool, checkpoint_pool) == [expect]
    return receipt


async def _checkpoint_messages(checkpoint_pool, session_id):
    return await conversation._checkpoint_messages(checkpoint_pool, session_id)


def _summary(history):
    return [(m["role"], m["content"]) for m in history]


async def test_completed_turns_move_to_the_archive_and_the_model_sees_them_all(
        pool, checkpoint_pool, alice, monkeypatch):
    scope = alice[1]
    seen = spy_model_calls(monkeypatch, "id", preamble=True)
    session = await new_session(pool, scope, ECHO_TWICE)
    for word in ("one", "two", "three"):
        await _turn(pool, checkpoint_pool, scope, session, word)
    history = await conversation.messages(checkpoint_pool, session.id)
    assert _summary(history) == [
        (role, text) for w in ("one", "two", "three")
        for role, text in (("human", w), ("ai", ""), ("tool", f'{{"text":"t-{w}"}}'), ("ai", f"a-{w}"))]
    assert [m["position"] for m in history] == list(range(1, 13))
    # Each completion archived its turn, each row with its turn; the
    # checkpoint still holds the last turn (until the next one starts) and
    # readers show it once.
    archived = await rows(pool, "SELECT position, message_id, turn_id FROM yuxi.conversation "
                                "WHERE session_id = %s ORDER BY position", (session.id,))
    assert [r["message_id"] for r in archived] == [m["id"] for m in history]
    turns = await rows(pool, "SELECT id FROM yuxi.turns WHERE session_id = %s ORDER BY seq",
                       (session.id,))
    assert [r["turn_id"] for r in archived] == [t["id"] for t in turns for _ in range(4)]
    assert [m.id for m in await _checkpoint_messages(checkpoint_pool, session.id)] == \
        [m["id"] for m in history[8:]]
    # Every model call of the third turn saw the whole conversation so far,
    # after the preamble (identity, system prompt).
    third = seen[-2:]
    ids = [m["id"] for m in history]
    assert third[0][-9:] == ids[:9] and third[1][-11:] == ids[:11], third


async def test_a_failed_turn_keeps_its_messages_in_the_conversation(pool, checkpoint_pool, alice):
    # Max steps: the turn fails with its tool calls in the checkpoint; the
    # next turn archives them as they are, then goes on.
    scope = alice[1]
    loop = {"model": "replay", "tools": ["echo"], "max_steps": 2, "replay": {"rules": [
        {"match": "^loop", "steps": [{"call": [{"tool": "echo", "args": {"text": "x"}}]}] * 9}],
        "default": [{"say": "ok {{ input }}"}]}}
    session = await new_session(pool, scope, loop)
    await _turn(pool, checkpoint_pool, scope, session, "loop", expect="failed")
    before = _summary(await conversation.messages(checkpoint_pool, session.id))
    assert before[0] == ("human", "loop") and len(before) >= 3
    await _turn(pool, checkpoint_pool, scope, session, "after")
    after = await conversation.messages(checkpoint_pool, session.id)
    assert _summary(after) == before + [("human", "after"), ("ai", "ok after")]
    # The failed turn by the next turn's first run, that one by its completion.
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == len(before) + 2


async def test_a_cancelled_waiting_turn_is_archived_cleaned(pool, checkpoint_pool, alice):
    # A turn waiting on a question is cancelled: the cleanup answers its open
    # call; the next turn (after continue) archives exactly that.
    from tests.integration.test_user_waits import QUESTIONS
    scope = alice[1]
    session = await new_session(pool, scope, {"model": "replay", "tools": ["ask_user"],
                                              "replay": {"default": [QUESTIONS, {"say": "k"}]}})
    first = await sessions.receive_input(pool, scope, session.id, content="first")
    assert await drain(pool, checkpoint_pool) == ["suspended"]
    await sessions.cancel_turn(pool, scope, first.turn_id)
    assert await cleanup.clean_cancelled_turn(pool, checkpoint_pool, first.turn_id)
    cancelled = _summary(await conversation.messages(checkpoint_pool, session.id))
    assert cancelled == [("human", "first"), ("ai", ""), ("tool", cleanup.CANCELLED_RESULT)]
    await sessions.continue_queue(pool, scope, session.id)
    await sessions.receive_input(pool, scope, session.id, content="second")
    assert await drain(pool, checkpoint_pool) == ["suspended"]
    history = await conversation.messages(checkpoint_pool, session.id)
    assert _summary(history)[:4] == cancelled + [("human", "second")]
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == 3


async def test_a_late_steer_stays_in_its_turn(pool, checkpoint_pool, alice):
    from tests.integration import gated
    scope = alice[1]
    joined = {"model": "gated", "replay": {"default": [{"say": "{{ inputs|join('+') }}"}]}}
    with gated.gated_model() as gate:
        session, _, task = await gated.start_run(pool, checkpoint_pool, scope, joined, "a")
        await gate.calls.get()
        await sessions.receive_input(pool, scope, session.id, content="b")
        gate.opened.set()
        assert await task == "completed"
        await sessions.receive_input(pool, scope, session.id, content="c")
        assert await drain(pool, checkpoint_pool) == ["completed"]
    assert _summary(await conversation.messages(checkpoint_pool, session.id)) == [
        ("human", "a"), ("ai", "a"), ("human", "b"), ("ai", "a+b"), ("human", "c"), ("ai", "c")]


class _CutSaver:
    """A checkpointer whose first write fails as a cut connection would."""

    @staticmethod
    def make(conn):
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        class Cut(AsyncPostgresSaver):
            async def aput(self, *args, **kwargs):
                raise psycopg.OperationalError("server closed the connection unexpectedly")

        return Cut(conn)


FAILS_ON_LOOP = {"model": "replay", "tools": ["echo"], "max_steps": 1, "replay": {"rules": [
    {"match": "^loop", "steps": [{"call": [{"tool": "echo", "args": {"text": "x"}}]}] * 9}],
    "default": [{"say": "echo: {{ input }}"}]}}


async def test_a_crash_between_the_archive_and_the_reset_loses_and_doubles_nothing(
        pool, checkpoint_pool, alice):
    # A failed turn is archived by the next turn's first run, which dies
    # before its first checkpoint; its retry archives nothing twice.
    scope = alice[1]
    session = await new_session(pool, scope, FAILS_ON_LOOP)
    await _turn(pool, checkpoint_pool, scope, session, "loop", expect="failed")
    failed = _summary(await conversation.messages(checkpoint_pool, session.id))
    assert failed[0] == ("human", "loop") and len(failed) >= 2
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == 0
    await sessions.receive_input(pool, scope, session.id, content="two")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    run = await runs.start_run(pool, run_id, token, 30)
    ex = executor(pool, checkpoint_pool)
    async with fenced_saver(checkpoint_pool, run_id, token) as saver:
        graph, cfg = ex._graph(run, token, _CutSaver.make(saver.conn))
        with pytest.raises(psycopg.OperationalError):
            await executor_module.drive(
                graph, cfg, run, conv=executor_module.TurnConversation(saver.conn, run, token))
        # Archived, and still in the checkpoint: readers show it once.
        assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == len(failed)
        assert len(await _checkpoint_messages(checkpoint_pool, session.id)) == len(failed)
        assert _summary(await conversation.messages(checkpoint_pool, session.id)) == failed
        # The retry archives nothing twice and finishes the turn.
        retry = {**run, "attempt": 2}
        graph, cfg = ex._graph(retry, token, saver)
        answer, _ = await executor_module.drive(
            graph, cfg, retry, conv=executor_module.TurnConversation(saver.conn, retry, token))
    assert answer.text == "echo: two"
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == len(failed)
    assert _summary(await conversation.messages(checkpoint_pool, session.id)) == \
        failed + [("human", "two"), ("ai", "echo: two")]


async def test_without_the_archive_check_a_retry_doubles_the_history(
        pool, checkpoint_pool, alice):
    # Negative case: without the last-row check, archiving the same batch
    # again (the retry after a crash before the reset) writes it twice.
    scope = alice[1]
    await rewrite_function(pool, "yuxi.append_conversation_v1",
                           "IF FOUND AND v_last.message_id = p_ids[v_count] THEN",
                           "IF false THEN")
    session = await new_session(pool, scope, say_agent())
    await _turn(pool, checkpoint_pool, scope, session, "one")
    await sessions.receive_input(pool, scope, session.id, content="two")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    run = await runs.start_run(pool, run_id, token, 30)
    async with fenced_saver(checkpoint_pool, run_id, token) as saver:
        batch = await _checkpoint_messages(checkpoint_pool, session.id)
        await conversation.archive_and_load(saver.conn, run_id, token, batch)
        await conversation.archive_and_load(saver.conn, run_id, token, batch)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == 6


async def test_without_the_reader_check_a_crash_window_shows_messages_twice(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative case: a reader that takes the checkpoint's messages as
    # unarchived while the archive holds them already shows them twice.
    scope = alice[1]
    session = await new_session(pool, scope, say_agent())
    await _turn(pool, checkpoint_pool, scope, session, "one")
    await sessions.receive_input(pool, scope, session.id, content="two")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    await runs.start_run(pool, run_id, token, 30)
    async with fenced_saver(checkpoint_pool, run_id, token) as saver:
        batch = await _checkpoint_messages(checkpoint_pool, session.id)
        await conversation.archive_and_load(saver.conn, run_id, token, batch)
    assert len(await conversation.messages(checkpoint_pool, session.id)) == 2
    monkeypatch.setattr(conversation, "unarchived", lambda messages, last: list(messages))
    assert len(await conversation.messages(checkpoint_pool, session.id)) == 4


async def test_the_archive_is_fenced_by_the_lease(pool, checkpoint_pool, alice):
    scope = alice[1]
    session = await new_session(pool, scope, say_agent())
    await _turn(pool, checkpoint_pool, scope, session, "one")
    await sessions.receive_input(pool, scope, session.id, content="two")
    (run_id,) = await runs_with_status(pool, "ready")
    token = uuid.uuid4()
    await runs.start_run(pool, run_id, token, 30)
    batch = await _checkpoint_messages(checkpoint_pool, session.id)
    async with checkpoint_pool.connection() as conn:
        with pytest.raises(LeaseLost):
            await conversation.archive_and_load(conn, run_id, uuid.uuid4(), batch + batch)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == 2  # turn one's


WRITTEN = """
CREATE TABLE public.written (bytes bigint NOT NULL);
CREATE FUNCTION public.count_written() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.written VALUES (pg_column_size(NEW.*));
    RETURN NULL;
END $$;
CREATE TRIGGER written AFTER INSERT OR UPDATE ON langgraph.checkpoint_blobs
    FOR EACH ROW EXECUTE FUNCTION public.count_written();
CREATE TRIGGER written AFTER INSERT OR UPDATE ON langgraph.checkpoints
    FOR EACH ROW EXECUTE FUNCTION public.count_written();
CREATE TRIGGER written AFTER INSERT OR UPDATE ON langgraph.checkpoint_writes
    FOR EACH ROW EXECUTE FUNCTION public.count_written();
"""


async def _written_per_turn(pool, checkpoint_pool, scope, marks=(10, 20, 40, 50)):
    """Bytes written to the checkpoint tables (each row as stored) per turn,
    over turns 10-20 and 40-50 of one session with ~0.7 KB answers."""
    async with pool.connection() as conn:
        await conn.execute(WRITTEN)
    session = await new_session(pool, scope, say_agent("answer {{ input }} " + "x" * 600))
    total = {}
    for i in range(1, marks[-1] + 1):
        await _turn(pool, checkpoint_pool, scope, session, f"question {i} " + "y" * 100)
        if i in marks:
            total[i] = await scalar(pool, "SELECT coalesce(sum(bytes), 0) FROM public.written")
    return (float(total[20] - total[10]) / 10, float(total[50] - total[40]) / 10, session)


async def test_bytes_written_per_turn_are_flat(pool, checkpoint_pool, alice):
    early, late, session = await _written_per_turn(pool, checkpoint_pool, alice[1])
    print("written per turn", early, late)
    assert late <= 1.3 * early and late < 8192, (early, late)
    history = await conversation.messages(checkpoint_pool, session.id)
    assert [m["content"].split()[1] for m in history if m["role"] == "human"] == \
        [str(i) for i in range(1, 51)]


async def test_without_the_reset_bytes_written_per_turn_grow(
        pool, checkpoint_pool, alice, monkeypatch):
    # Negative case: a turn's input without RemoveMessage(all) keeps every
    # earlier message in the checkpoint, and each write rewrites them.
    from langchain_core.messages import HumanMessage
    monkeypatch.setattr(executor_module, "RESET", HumanMessage(content="", id="no-reset"))
    early, late, _ = await _written_per_turn(pool, checkpoint_pool, alice[1])
    assert late > 1.5 * early, (early, late)


# -- GET /api/sessions/{id}/messages ------------------------------------------

@pytest.fixture
async def client(db_url):
    from yuxi.api.app import create_app
    from yuxi.settings import Settings

    app = create_app(Settings(database_url=db_url, default_model="replay"))
    async with AsyncTestClient(app=app) as c:
        yield c


async def test_pages_walk_the_whole_conversation_by_keyset(
        client, pool, checkpoint_pool, alice):
    key, scope = alice
    headers = {"Authorization": f"Bearer {key}"}
    session = await new_session(pool, scope, say_agent())
    for i in range(1, 13):
        await _turn(pool, checkpoint_pool, scope, session, f"q{i}")
    url = f"/api/sessions/{session.id}/messages"
    everything = (await client.get(url, headers=headers)).json()  # default limit: 100
    assert [m["position"] for m in everything] == list(range(1, 25))
    assert everything[-1] == {"id": everything[-1]["id"], "role": "ai", "content": "echo: q12",
                              "position": 24}
    pages, before = [], None
    while True:
        params = {"limit": 5, **({"before": before} if before else {})}
        page = (await client.get(url, headers=headers, params=params)).json()
        pages.append(page)
        if not page or page[0]["position"] == 1:
            break
        before = page[0]["position"]
    assert [len(p) for p in pages] == [5, 5, 5, 5, 4]
    assert [m for p in reversed(pages) for m in p] == everything
    # The first page reaches into the checkpoint (the last turn), deeper ones
    # only the archive.
    assert (await client.get(url, headers=headers, params={"limit": 1})).json() == \
        everything[-1:]
    assert (await client.get(url, headers=headers, params={"before": 24})).json() == \
        everything[:-1]
    assert (await client.get(url, headers=headers, params={"before": 1})).json() == []


async def test_a_page_of_a_waiting_turn_continues_the_positions(
        client, pool, checkpoint_pool, alice):
    from tests.integration.test_user_waits import QUESTIONS
    key, scope = alice
    headers = {"Authorization": f"Bearer {key}"}
    session = await new_session(pool, scope, {"model": "replay", "tools": ["ask_user"],
                                              "replay": {"rules": [
                                                  {"match": "^ask", "steps": [QUESTIONS]}],
                                                  "default": [{"say": "ok"}]}})
    await _turn(pool, checkpoint_pool, scope, session, "hi")
    await _turn(pool, checkpoint_pool, scope, session, "ask", expect="suspended")
    page = (await client.get(f"/api/sessions/{session.id}/messages", headers=headers)).json()
    assert [(m["position"], m["role"], m["content"]) for m in page] == [
        (1, "human", "hi"), (2, "ai", "ok"), (3, "human", "ask"), (4, "ai", "")]
    assert page[3]["tool_calls"][0]["name"] == "ask_user"


@pytest.mark.parametrize("params", [
    {"limit": 0}, {"limit": 501}, {"limit": "x"}, {"before": 0}, {"before": -3},
    {"before": "1.5"}, {"before": 2**31}])
async def test_bad_page_parameters_are_422_with_a_code(client, pool, alice, params):
    key, scope = alice
    session = await new_session(pool, scope)
    response = await client.get(f"/api/sessions/{session.id}/messages",
                                headers={"Authorization": f"Bearer {key}"}, params=params)
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "validation_error", response.text


async def _page_plan(pool, scope, *, drop_key: bool = False) -> str:
    """The generic plan of a page 15,000 rows deep into one of three
    sessions of 20,000 archived messages each."""
    from yuxi import db
    made = [await new_session(pool, scope) for _ in range(3)]
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO yuxi.conversation (session_id, position, message_id, serde, message) "
            "SELECT s, p, 'm' || p, 'msgpack', '\\x00' FROM unnest(%s::uuid[]) s, "
            "generate_series(1, 20000) p", ([s.id for s in made],))
        if drop_key:
            await conn.execute("ALTER TABLE yuxi.conversation DROP CONSTRAINT conversation_pkey")
        await conn.execute("ANALYZE yuxi.conversation")
        # The checkpoint pool prepares its statements: the generic plan.
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        sql = db.QUERIES["conversation_page"].replace("%(session_id)s", "$1") \
            .replace("%(before)s", "$2").replace("%(limit)s", "$3")
        await conn.execute(f"PREPARE page(uuid, integer, integer) AS {sql}")
        cur = await conn.execute("EXPLAIN (ANALYZE, COSTS OFF) "
                                 f"EXECUTE page('{made[1].id}', 15000, 50)")
        return "\n".join(r["QUERY PLAN"] for r in await cur.fetchall())


async def test_a_page_is_a_backward_range_scan_of_the_primary_key(pool, alice):
    # O(page): a backward index range scan with the session and the cursor
    # in its index condition, 50 rows read for 50 returned.
    plan = await _page_plan(pool, alice[1])
    assert "Index Scan Backward using conversation_pkey" in plan, plan
    assert 'Index Cond: ((session_id = $1) AND ("position" < $2))' in plan, plan
    assert "Sort" not in plan and "Seq Scan" not in plan and "Filter" not in plan, plan
    assert "rows=50 " in plan, plan


async def test_without_the_key_a_page_reads_the_history(pool, alice):
    # Negative case: without the (session_id, position) key the page is a
    # scan of every row and a sort.
    plan = await _page_plan(pool, alice[1], drop_key=True)
    assert "Index Scan Backward using conversation_pkey" not in plan, plan
    assert "Seq Scan" in plan and "Sort" in plan, plan


async def test_a_turn_given_up_by_recovery_keeps_what_it_did(pool, checkpoint_pool, alice):
    # The worker dies after the tool step; recovery gives up (no worker ever
    # ends the turn): the next turn archives the checkpoint's partial turn.
    import asyncio

    from tests.integration import gated
    scope = alice[1]
    config = {"model": "gated", "tools": ["echo"], "replay": {"default": [
        {"call": [{"tool": "echo", "args": {"text": "once"}}]}, {"say": "done"}]}}
    with gated.gated_model() as gate:
        session, receipt, first = await gated.start_run(pool, checkpoint_pool, scope, config, "a")
        await gate.calls.get()
        (run_id,) = await runs_with_status(pool, "running")
        gate.pass_waiting()  # the tool call; the model's next call waits
        await gate.calls.get()
        first.cancel()  # the worker dies under its lease
        await asyncio.gather(first, return_exceptions=True)
        await scalar(pool, "UPDATE yuxi.runs SET lease_expires_at = clock_timestamp() "
                           "- interval '1 s' WHERE id = %s RETURNING id", (run_id,))
        await runs.recover_expired(pool, max_attempts=1)
        assert await scalar(pool, "SELECT status FROM yuxi.turns WHERE id = %s",
                            (receipt.turn_id,)) == "failed"
        partial = _summary(await conversation.messages(checkpoint_pool, session.id))
        assert [r for r, _ in partial] == ["human", "ai", "tool"]
        gate.opened.set()
        await sessions.receive_input(pool, scope, session.id, content="b")
        assert await drain(pool, checkpoint_pool) == ["completed"]
    history = _summary(await conversation.messages(checkpoint_pool, session.id))
    assert history[:3] == partial and history[3] == ("human", "b") and len(history) == 7
    assert history[-1] == ("ai", "done")
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == 7


async def test_handed_over_turns_carry_the_conversation(pool, checkpoint_pool, alice, monkeypatch):
    # Turns queued behind a running one are handed over to the same worker by
    # the completion; the worker gives the next run the history and the
    # final messages it holds (no checkpoint or archive read). The model sees
    # the same conversation and the archive is the same as without hand-over.
    scope = alice[1]
    seen = spy_model_calls(monkeypatch, "id")
    session = await new_session(pool, scope, ECHO_TWICE)
    for word in ("one", "two", "three"):
        await sessions.receive_input(pool, scope, session.id, content=word, mode="queue")
    assert await drain(pool, checkpoint_pool) == ["completed"]  # one job, three turns
    assert await scalar(pool, "SELECT count(*) FROM yuxi.turns WHERE status = 'completed'") == 3
    history = await conversation.messages(checkpoint_pool, session.id)
    ids = [m["id"] for m in history]
    assert _summary(history)[-4:] == [("human", "three"), ("ai", ""),
                                      ("tool", '{"text":"t-three"}'), ("ai", "a-three")]
    assert len(history) == 12 and [m["position"] for m in history] == list(range(1, 13))
    # Each model call saw every earlier message, in order, and nothing twice.
    assert seen == [ids[:1], ids[:3], ids[:5], ids[:7], ids[:9], ids[:11]], seen
    archived = await rows(pool, "SELECT message_id FROM yuxi.conversation "
                                "WHERE session_id = %s ORDER BY position", (session.id,))
    assert [r["message_id"] for r in archived] == ids  # each completion archived its turn


ARCHIVE_AT_COMPLETION = """PERFORM yuxi.append_conversation_v1(v_run.session_id, p_archive_ids, p_archive_turns,
                                        p_archive_serde, p_archive_messages);"""


async def test_a_completed_turn_is_archived_by_its_completion(pool, checkpoint_pool, alice):
    scope = alice[1]
    session = await new_session(pool, scope, say_agent())
    await _turn(pool, checkpoint_pool, scope, session, "one")
    assert await rows(pool, "SELECT position, message_id FROM yuxi.conversation") == [
        {"position": 1, "message_id": m["id"]} if i == 0 else
        {"position": 2, "message_id": m["id"]}
        for i, m in enumerate(await conversation.messages(checkpoint_pool, session.id))]


async def test_without_the_archive_at_completion_a_completed_turn_waits_for_the_next(
        pool, checkpoint_pool, alice):
    # Negative case: complete_run_v1 without its archive leaves the turn to
    # the next turn's first run (the conversation is still whole).
    scope = alice[1]
    await rewrite_function(pool, "yuxi.complete_run_v1", ARCHIVE_AT_COMPLETION, "")
    session = await new_session(pool, scope, say_agent())
    await _turn(pool, checkpoint_pool, scope, session, "one")
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == 0
    await _turn(pool, checkpoint_pool, scope, session, "two")
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == 2
    assert len(await conversation.messages(checkpoint_pool, session.id)) == 4


async def test_a_completion_that_does_not_commit_archives_nothing(pool, checkpoint_pool, alice):
    # Crash point: the archive is part of the completing transaction.
    scope = alice[1]
    await rewrite_function(pool, "yuxi.complete_run_v1", ARCHIVE_AT_COMPLETION,
                           ARCHIVE_AT_COMPLETION + " RAISE EXCEPTION 'crash after the archive';")
    session = await new_session(pool, scope, say_agent())
    await sessions.receive_input(pool, scope, session.id, content="one")
    await drain(pool, checkpoint_pool)
    assert await scalar(pool, "SELECT count(*) FROM yuxi.runs WHERE status = 'completed'") == 0
    assert await scalar(pool, "SELECT count(*) FROM yuxi.conversation") == 0


async def test_a_read_uses_one_connection_of_the_pool(pool, checkpoint_pool, alice, db_url):
    # A request never holds one connection while it waits for another: with
    # a pool of one, a page still reads the archive and the checkpoint (two
    # connections at once would wait until the pool's timeout).
    from yuxi import db
    scope = alice[1]
    session = await new_session(pool, scope, say_agent())
    for word in ("one", "two"):
        await _turn(pool, checkpoint_pool, scope, session, word)
    single = db.checkpoint_pool(db_url, min_size=1, max_size=1, timeout=2)
    await single.open(wait=True)
    try:
        page = await conversation.messages(single, session.id, limit=3)
    finally:
        await single.close()
    assert _summary(page) == [("ai", "echo: one"), ("human", "two"), ("ai", "echo: two")]


def _count_decodes(monkeypatch) -> list[int]:
    decoded: list[int] = []
    real = conversation._load

    def counted(serde, data):
        decoded.append(1)
        return real(serde, data)

    monkeypatch.setattr(conversation, "_load", counted)
    return decoded


@pytest.mark.parametrize("kept", [1 << 20, 0], ids=["cached", "nothing kept"])
async def test_a_later_turn_decodes_only_what_was_archived_since(
        pool, checkpoint_pool, alice, monkeypatch, kept):
    # The archive only grows: what this process decoded of a session's
    # archive stays true, and each turn's first run decodes the messages
    # archived since. The negative (nothing kept): every earlier message at
    # every turn. The model sees the same conversation either way.
    monkeypatch.setattr(conversation, "ARCHIVE", conversation.ArchiveCache(kept))
    decoded = _count_decodes(monkeypatch)
    seen = spy_model_calls(monkeypatch)
    scope = alice[1]
    session = await new_session(pool, scope, say_agent("a-{{ input }}"))
    per_turn = []
    for text in ("one", "two", "three", "four"):
        before = len(decoded)
        await _turn(pool, checkpoint_pool, scope, session, text)
        per_turn.append(len(decoded) - before)
    assert per_turn == ([0, 2, 2, 2] if kept else [0, 2, 4, 6])
    assert seen[-1] == ["one", "a-one", "two", "a-two", "three", "a-three", "four"]


def test_the_archive_cache_keeps_a_prefix_and_drops_the_least_used_sessions():
    from langchain_core.messages import AIMessage, HumanMessage

    def rows(n, tag=""):
        messages = [HumanMessage(f"m{i}{tag}", id=f"m{i}{tag}") if i % 2 == 0 else
                    AIMessage(f"m{i}{tag}", id=f"m{i}{tag}") for i in range(n)]
        p = conversation.archive_params(messages)
        return [{"message_id": i, "serde": s, "message": m}
                for i, s, m in zip(p["ids"], p["serde"], p["messages"])]

    def size(rs):
        return sum(len(r["message"]) for r in rs)

    # Room for sessions "a" (4 messages) and "b" (2), as stored.
    cache = conversation.ArchiveCache(max_bytes=size(rows(4)) + size(rows(2)))
    first = cache.load("a", rows(2))
    again = cache.load("a", rows(4))
    assert [m.content for m in again] == ["m0", "m1", "m2", "m3"]
    assert again[0] is first[0]  # the prefix was not decoded again
    cache.load("b", rows(2))  # full
    cache.load("c", rows(2))  # over: "a", the least recently used, goes
    assert cache.nbytes == 2 * size(rows(2))
    assert cache.load("a", rows(4))[0] is not first[0]
    # Rows that do not continue what is kept (never expected) are all decoded.
    other = cache.load("b", rows(3, tag="x"))
    assert [m.content for m in other] == ["m0x", "m1x", "m2x"]
    # A session longer than the whole cache is not kept.
    cache.load("d", rows(7))
    assert cache.known("d") == 0
    assert cache.load("d", rows(7))[0] is not cache.load("d", rows(7))[0]
    # Rows past what `known` said complete what is kept; past a prefix no
    # longer kept, None (read it whole).
    cache = conversation.ArchiveCache()
    first = cache.load("e", rows(2))
    assert cache.known("e") == 2 and cache.known("f") == 0
    grown = cache.load("e", rows(5)[2:], after=2)
    assert [m.content for m in grown] == ["m0", "m1", "m2", "m3", "m4"] and grown[0] is first[0]
    assert cache.known("e") == 5 and cache.nbytes == size(rows(5))
    assert cache.load("f", rows(4)[2:], after=2) is None


async def _claimed_turns(pool, checkpoint_pool, scope, session, texts, *, announced=True):
    """Each text a turn whose run is executed as a claim's (the announced
    session known) or as a job's; what each lease's read returned of the
    archive."""
    read: list[int] = []
    real = runs.start_run_reading

    async def spied(*args, **kwargs):
        run, results = await real(*args, **kwargs)
        read.append(len(results[1]))
        return run, results

    import unittest.mock

    with unittest.mock.patch.object(executor_module.runs, "start_run_reading", spied):
        for text in texts:
            await sessions.receive_input(pool, scope, session.id, content=text)
            (run_id,) = await runs_with_status(pool, "ready")
            assert await executor(pool, checkpoint_pool).execute(
                run_id, session_id=session.id if announced else None) == "completed"
    return read


@pytest.mark.parametrize("announced", [True, False], ids=["claim", "job"])
async def test_a_claimed_run_reads_only_the_archive_past_what_its_worker_holds(
        pool, checkpoint_pool, alice, monkeypatch, announced):
    # A claim knows the run's session from its announcement: the lease's
    # round trip reads only the rows past what this process holds. A job
    # (the session unknown) reads the whole archive: each case is the
    # other's negative. The model sees the whole conversation either way.
    monkeypatch.setattr(conversation, "ARCHIVE", conversation.ArchiveCache())
    seen = spy_model_calls(monkeypatch)
    scope = alice[1]
    session = await new_session(pool, scope, say_agent("a-{{ input }}"))
    read = await _claimed_turns(pool, checkpoint_pool, scope, session,
                                ["one", "two", "three", "four"], announced=announced)
    assert read == ([0, 2, 2, 2] if announced else [0, 2, 4, 6])
    assert seen[-1] == ["one", "a-one", "two", "a-two", "three", "a-three", "four"]


async def test_a_prefix_dropped_after_the_lease_is_read_again_whole(
        pool, checkpoint_pool, alice, monkeypatch):
    # The cache dropped the session between the claim (which read past its
    # prefix) and the run's load: the run reads the archive whole, and its
    # model still sees all of it.
    class Forgetful(conversation.ArchiveCache):
        def known(self, session_id):
            held = super().known(session_id)
            self._sessions.clear()  # dropped meanwhile (other sessions' loads)
            self._size = 0
            return held

    monkeypatch.setattr(conversation, "ARCHIVE", Forgetful())
    seen = spy_model_calls(monkeypatch)
    scope = alice[1]
    session = await new_session(pool, scope, say_agent("a-{{ input }}"))
    read = await _claimed_turns(pool, checkpoint_pool, scope, session, ["one", "two", "three"])
    assert read == [0, 2, 2]  # the lease read past what was held then
    assert seen[-1] == ["one", "a-one", "two", "a-two", "three"]


async def test_a_run_that_reads_its_own_archive_reads_past_what_its_worker_holds(
        pool, checkpoint_pool, alice, monkeypatch):
    # A run with no read of the lease's (handed over by another session's
    # completion; here: the lease's read unused) reads the checkpoint and
    # the archive itself, also past what this process holds decoded.
    from yuxi.runtime.saver import RunSaver

    async def unknown(self, thread_id, row):
        return False

    monkeypatch.setattr(RunSaver, "know_latest", unknown)
    monkeypatch.setattr(conversation, "ARCHIVE", conversation.ArchiveCache())
    read: list[int] = []
    real = RunSaver.aget_tuple_with

    async def spied(self, config, query, params):
        found, rows = await real(self, config, query, params)
        read.append(len(rows))
        return found, rows

    monkeypatch.setattr(RunSaver, "aget_tuple_with", spied)
    seen = spy_model_calls(monkeypatch)
    scope = alice[1]
    session = await new_session(pool, scope, say_agent("a-{{ input }}"))
    for text in ("one", "two", "three", "four"):
        await _turn(pool, checkpoint_pool, scope, session, text)
    assert read == [0, 2, 2, 2]
    assert seen[-1] == ["one", "a-one", "two", "a-two", "three", "a-three", "four"]


async def test_an_announcement_naming_another_session_reads_the_archive_whole(
        pool, checkpoint_pool, alice, monkeypatch):
    # The lease reads past what the cache holds of the announced session;
    # for another session's run that prefix is not its own (ArchiveCache.load
    # checks its length): the run reads its archive whole and its model sees
    # its own conversation.
    monkeypatch.setattr(conversation, "ARCHIVE", conversation.ArchiveCache())
    seen = spy_model_calls(monkeypatch)
    scope = alice[1]
    a = await new_session(pool, scope, say_agent("a-{{ input }}"))
    b = await new_session(pool, scope, say_agent("a-{{ input }}"))
    await _claimed_turns(pool, checkpoint_pool, scope, a, ["x1", "x2", "x3", "x4"])
    await _claimed_turns(pool, checkpoint_pool, scope, b, ["y1", "y2"])
    assert conversation.ARCHIVE.known(a.id) == 6 and conversation.ARCHIVE.known(b.id) == 2
    await sessions.receive_input(pool, scope, b.id, content="y3")
    (run_id,) = await runs_with_status(pool, "ready")
    assert await executor(pool, checkpoint_pool).execute(run_id, session_id=a.id) == "completed"
    assert seen[-1] == ["y1", "a-y1", "y2", "a-y2", "y3"]
