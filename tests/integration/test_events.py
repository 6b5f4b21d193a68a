"""Events are gap-free per tree and commit in sequence order, so a reader with
cursor N never misses an event that commits later with a smaller number."""

from __future__ import annotations

import psycopg
import pytest

from tests.integration.test_slots import make_tree

EMIT = "SELECT yuxi.emit_event_v1(%s, %s, NULL, NULL, 'test.event', '{}', %s)"


def read_after(conn, tree, cursor) -> list[int]:
    return [r[0] for r in conn.execute(
        "SELECT seq FROM yuxi.events WHERE tree_id = %s AND seq > %s ORDER BY seq", (tree, cursor))]


def _interleave(db_url, tree, root) -> list[int]:
    """Writer 1 takes a number and stays uncommitted; writer 2 tries to write
    and commit; a reader follows with a cursor. Returns what the reader saw."""
    seen: list[int] = []
    with psycopg.connect(db_url) as w1, psycopg.connect(db_url) as w2, \
            psycopg.connect(db_url, autocommit=True) as reader:
        cursor = read_after(reader, tree, 0)[-1]
        w1.execute(EMIT, (tree, root, None))
        w2.execute("SET lock_timeout = '200ms'")
        try:
            w2.execute(EMIT, (tree, root, None))
            w2.commit()
        except psycopg.errors.LockNotAvailable:
            w2.rollback()
        for seq in read_after(reader, tree, cursor):  # the reader polls now
            seen.append(seq)
            cursor = seq
        w1.commit()
        w2.execute("SET lock_timeout = 0")
        w2.execute(EMIT, (tree, root, None))
        w2.commit()
        seen.extend(read_after(reader, tree, cursor))
    return seen


def test_a_second_writer_waits_and_no_reader_skips(db_url, postgresql):
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    first = read_after(postgresql, tree, 0)[-1]
    seen = _interleave(db_url, tree, root)
    # Everything committed after the cursor is seen, once, in order.
    all_after = read_after(postgresql, tree, first)
    assert seen == all_after == list(range(first + 1, first + 1 + len(all_after)))


def test_without_the_tree_row_a_reader_skips_an_event(db_url, postgresql):
    # Negative case: numbers from a sequence (no tree row lock) let a later
    # number commit first; the reader's cursor passes the earlier one.
    postgresql.execute("CREATE SEQUENCE yuxi.unlocked_seq START 1000")
    postgresql.execute("""
        CREATE OR REPLACE FUNCTION yuxi.emit_event_v1(
            p_tree uuid, p_session uuid, p_turn uuid, p_run uuid,
            p_type text, p_data jsonb DEFAULT '{}', p_dedupe_key text DEFAULT NULL)
        RETURNS bigint LANGUAGE sql AS $$
            INSERT INTO yuxi.events (tree_id, seq, user_id, app_id, session_id, type, data)
            SELECT p_tree, nextval('yuxi.unlocked_seq'), user_id, app_id, p_session, p_type, '{}'
            FROM yuxi.trees WHERE id = p_tree RETURNING seq $$""")
    tree, (root,) = make_tree(postgresql, 1)
    postgresql.commit()
    start = read_after(postgresql, tree, 0)[-1]
    seen = _interleave(db_url, tree, root)
    committed = read_after(postgresql, tree, start)
    assert sorted(seen) != committed  # an event was skipped


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
