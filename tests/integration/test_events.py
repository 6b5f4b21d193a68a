"""Events are gap-free per tree and commit in sequence order, so a reader with
cursor N never misses an event that commits later with a smaller number."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from tests.integration.helpers import rewrite_function_sync
from tests.integration.test_config import wait_until_blocked
from tests.integration.test_slots import make_tree

EMIT = "SELECT yuxi.emit_event_v1(%s, %s, NULL, NULL, 'test.event', '{}', %s)"


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
