"""Events are gap-free per tree and commit in sequence order, so a reader with
cursor N never misses an event that commits later with a smaller number."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import psycopg.types.json
import pytest

from tests.integration.helpers import rewrite_function_sync
from tests.integration.test_config import wait_until_blocked
from tests.integration.test_slots import make_tree

EMIT = "SELECT yuxi.emit_event_v1(%s, %s, NULL, NULL, 'test.event', '{}', %s)"
# A watch of the tree by the calling backend (yuxi.event_watches): only a
# watched tree's transactions send `yuxi_events`.
WATCH = "SELECT yuxi.watch_events_v1(%s)"


def read_after(conn, tree, cursor) -> list[int]:
    return [r[0] for r in conn.execute(
        "SELECT seq FROM yuxi.events WHERE tree_id = %s AND seq > %s ORDER BY seq", (tree, cursor))]


def _interleave(db_url, observer, tree, root) -> tuple[int, int, list[int]]:
    """Writer 1 takes a number and stays uncommitted; writer 2 tries to write
    meanwhile (it must wait: its call has not returned while writer 1 is
    open); a reader polls with a cursor, then writer 1 commits and writer 2's
    call returns and commits. Returns both numbers and what the reader saw."""
    seen: list[int] = []
    with psycopg.connect(db_url) as w1, psycopg.connect(db_url) as w2, \
            psycopg.connect(db_url, autocommit=True) as reader, ThreadPoolExecutor(1) as threads:
        cursor = read_after(reader, tree, 0)[-1]
        first = w1.execute(EMIT, (tree, root, None)).fetchone()[0]
        second = threads.submit(lambda: w2.execute(EMIT, (tree, root, None)).fetchone()[0])
        wait_until_blocked(observer, w2.info.backend_pid)
        seen.extend(read_after(reader, tree, cursor))  # the reader polls now
        cursor = seen[-1] if seen else cursor
        w1.commit()
        number = second.result(timeout=10)
        w2.commit()
        seen.extend(read_after(reader, tree, cursor))
    return first, number, seen


def test_a_second_writer_waits_and_no_reader_skips(db_url, postgresql):
    # Guard: emit_event_v1 takes the next number under the tree row lock
    # (lock_tree_v1), held until commit. Writer 2 waits for writer 1, then
    # reads writer 1's number and takes the next one.
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    start = read_after(postgresql, tree, 0)[-1]
    first, second, seen = _interleave(db_url, postgresql, tree, root)
    assert (first, second) == (start + 1, start + 2)
    # Everything committed after the cursor is seen, once, in order.
    assert seen == read_after(postgresql, tree, start) == [start + 1, start + 2]


def test_without_the_tree_row_lock_a_second_writer_fails(db_url, postgresql):
    # Negative case: emit_event_v1 reads the tree row without locking it.
    # Both writers then read the same last number; the (tree_id, seq) primary
    # key makes writer 2 wait for writer 1 (so a reader still skips nothing),
    # but once writer 1 commits, writer 2's transaction fails: the transition
    # that wanted to report its event is lost.
    rewrite_function_sync(postgresql, "yuxi.emit_event_v1",
                          "v_tree := yuxi.lock_tree_v1(p_tree);",
                          "SELECT * INTO v_tree FROM yuxi.trees WHERE id = p_tree;")
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    with pytest.raises(psycopg.errors.UniqueViolation, match="events_pkey"):
        _interleave(db_url, postgresql, tree, root)


def test_dedupe_key_reports_a_fact_once_without_a_gap(postgresql):
    tree, (root,) = make_tree(postgresql, 1)
    a = postgresql.execute(EMIT, (tree, root, "k1")).fetchone()[0]
    assert postgresql.execute(EMIT, (tree, root, "k1")).fetchone()[0] is None
    b = postgresql.execute(EMIT, (tree, root, "k2")).fetchone()[0]
    assert b == a + 1


def test_events_notify_their_tree_once_per_transaction_after_commit(db_url, postgresql):
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    with psycopg.connect(db_url, autocommit=True) as listener, psycopg.connect(db_url) as writer:
        listener.execute(WATCH, (tree,))
        listener.execute("LISTEN yuxi_events")
        first = writer.execute(EMIT, (tree, root, None)).fetchone()[0]
        second = writer.execute(EMIT, (tree, root, None)).fetchone()[0]
        assert second == first + 1
        assert list(listener.notifies(timeout=0.2)) == []  # nothing before commit
        writer.commit()
        notes = list(listener.notifies(timeout=0.5))
        assert [n.payload for n in notes] == [str(tree)]  # ids only, one per transaction


@pytest.mark.parametrize("bad_type", ["Bad", "a..b", "", "x y"])
def test_event_type_shape_is_checked(postgresql, bad_type):
    tree, (root,) = make_tree(postgresql, 1)
    with pytest.raises(psycopg.errors.CheckViolation, match="events_type_shape"):
        postgresql.execute("SELECT yuxi.emit_event_v1(%s, %s, NULL, NULL, %s, '{}', NULL)",
                           (tree, root, bad_type))


EMIT_TURN = "SELECT yuxi.emit_event_v1(%s, %s, %s, NULL, %s, '{}', NULL)"


@pytest.mark.parametrize("end", ["turn.completed", "turn.failed", "turn.cancelled"])
def test_a_turns_end_notifies_its_turn_after_commit(db_url, postgresql, end):
    # Who waits for a turn's end is woken by that turn's own notification
    # (`yuxi_turns`); other events of the tree, and other turns' starts, send
    # none.
    import uuid

    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    ended, started = uuid.uuid4(), uuid.uuid4()
    with psycopg.connect(db_url, autocommit=True) as listener, psycopg.connect(db_url) as writer:
        listener.execute("LISTEN yuxi_turns")
        writer.execute(EMIT, (tree, root, None))
        writer.execute(EMIT_TURN, (tree, root, started, "turn.started"))
        writer.execute(EMIT_TURN, (tree, root, ended, end))
        assert list(listener.notifies(timeout=0.2)) == []  # nothing before commit
        writer.commit()
        assert [n.payload for n in listener.notifies(timeout=0.5)] == [str(ended)]


def _emit_and_commit(writer, tree, root) -> int:
    seq = writer.execute(EMIT, (tree, root, None)).fetchone()[0]
    writer.commit()
    return seq


def test_only_a_watched_tree_notifies_yuxi_events(db_url, postgresql):
    # NOTIFY serializes every notifying commit of the server and wakes every
    # listening backend: a tree nobody watches sends none. A watch of one
    # tree is not a watch of another; NULL watches every tree.
    a, (a_root,) = make_tree(postgresql, 1)
    b, (b_root,) = make_tree(postgresql, 1)
    postgresql.commit()
    with psycopg.connect(db_url, autocommit=True) as listener, psycopg.connect(db_url) as writer:
        listener.execute("LISTEN yuxi_events")
        _emit_and_commit(writer, a, a_root)
        assert list(listener.notifies(timeout=0.3)) == []
        listener.execute(WATCH, (a,))
        _emit_and_commit(writer, b, b_root)
        _emit_and_commit(writer, a, a_root)
        assert [n.payload for n in listener.notifies(timeout=0.5)] == [str(a)]
        listener.execute("SELECT yuxi.unwatch_events_v1(%s)", (a,))
        _emit_and_commit(writer, a, a_root)
        assert list(listener.notifies(timeout=0.3)) == []
        listener.execute(WATCH, (None,))  # every tree (an operator's psql)
        _emit_and_commit(writer, b, b_root)
        writer.execute("SELECT yuxi.emit_events_v1(%s, %s)",
                       (a, psycopg.types.json.Jsonb([{"session_id": str(a_root),
                                                      "type": "test.batch"}])))
        writer.commit()
        assert [n.payload for n in listener.notifies(timeout=0.5)] == [str(b), str(a)]


def _watch_during_a_write(db_url, observer, tree, root, *, blocks: bool) -> tuple[int, list, list]:
    """A writer writes an event of the unwatched tree and stays uncommitted;
    a watch of the tree (for the listener) starts meanwhile; once it returns
    (`blocks`: it must wait for the writer, which then commits), a reader
    reads after its cursor and the writer commits. Returns the writer's
    number, what the reader read and the notifications that arrived."""
    with psycopg.connect(db_url, autocommit=True) as listener, psycopg.connect(db_url) as writer, \
            psycopg.connect(db_url, autocommit=True) as watcher, \
            psycopg.connect(db_url, autocommit=True) as reader, ThreadPoolExecutor(1) as threads:
        listener.execute("LISTEN yuxi_events")
        cursor = read_after(reader, tree, 0)[-1]
        seq = writer.execute(EMIT, (tree, root, None)).fetchone()[0]
        watch = threads.submit(lambda: watcher.execute(
            "SELECT yuxi.watch_events_v1(%s, %s)", (tree, listener.info.backend_pid)))
        if blocks:
            wait_until_blocked(observer, watcher.info.backend_pid)
            writer.commit()
        watch.result(timeout=10)
        seen = read_after(reader, tree, cursor)  # the watcher's first read
        writer.commit()
        return seq, seen, [n.payload for n in listener.notifies(timeout=0.5)]


def test_a_watch_waits_for_the_trees_writers_in_flight(db_url, postgresql):
    # Guard: watch_events_v1 locks the tree row FOR SHARE, which waits for a
    # writer holding it. A writer that checked before the watch committed is
    # read by the watcher's first read after it; later writers notify.
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    seq, seen, notes = _watch_during_a_write(db_url, postgresql, tree, root, blocks=True)
    assert seen == [seq] and notes == []
    with psycopg.connect(db_url) as writer, psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute("LISTEN yuxi_events")
        listener.execute(WATCH, (tree,))
        _emit_and_commit(writer, tree, root)
        assert [n.payload for n in listener.notifies(timeout=0.5)] == [str(tree)]


def test_without_waiting_for_writers_a_watch_misses_an_event(db_url, postgresql):
    # Negative case: a watch that does not wait for the tree's writers
    # returns at once; the writer in flight checked before it and commits
    # after the watcher's first read: that event is neither read nor
    # notified (a stream would stall until the tree's next write).
    rewrite_function_sync(postgresql, "yuxi.watch_events_v1",
                          "PERFORM 1 FROM yuxi.trees WHERE id = p_tree FOR SHARE;", "NULL;")
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    seq, seen, notes = _watch_during_a_write(db_url, postgresql, tree, root, blocks=False)
    assert seq and seen == [] and notes == []


def test_watches_of_backends_gone_are_forgotten(db_url, postgresql):
    tree, _ = make_tree(postgresql, 1)
    postgresql.commit()
    with psycopg.connect(db_url, autocommit=True) as live:
        live.execute(WATCH, (tree,))
        with psycopg.connect(db_url, autocommit=True) as gone:
            gone.execute(WATCH, (tree,))
            gone.execute(WATCH, (None,))
            gone_pid = gone.info.backend_pid
        # A closed connection's backend may take a moment to leave.
        for _ in range(500):
            if not postgresql.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                      (gone_pid,)).fetchone()[0]:
                break
            time.sleep(0.01)
        pids = "SELECT pid FROM yuxi.event_watches ORDER BY pid"
        assert postgresql.execute("SELECT yuxi.forget_watches_v1()").fetchone()[0] == 2
        assert [r[0] for r in postgresql.execute(pids)] == [live.info.backend_pid]
        # A listener's previous backend, named, goes even while it lives on.
        assert postgresql.execute("SELECT yuxi.forget_watches_v1(%s)",
                                  (live.info.backend_pid,)).fetchone()[0] == 1
        assert postgresql.execute(pids).fetchall() == []


def test_deltas_go_out_only_while_their_tree_is_watched(db_url, postgresql):
    from yuxi.db import QUERIES

    tree, _ = make_tree(postgresql, 1)
    postgresql.commit()
    with psycopg.connect(db_url, autocommit=True) as listener, \
            psycopg.connect(db_url, autocommit=True) as worker:
        listener.execute("LISTEN yuxi_deltas")
        params = {"payload": "d1", "tree_id": tree}
        worker.execute(QUERIES["notify_delta"], params)
        assert list(listener.notifies(timeout=0.3)) == []
        listener.execute(WATCH, (tree,))
        worker.execute(QUERIES["notify_delta"], {**params, "payload": "d2"})
        assert [n.payload for n in listener.notifies(timeout=0.5)] == ["d2"]
