-- Errors raised by yuxi functions use SQLSTATE class YX (Python maps them by
-- code in yuxi/errors.py, never by message text):
--   YX001 illegal transition   YX002 not found   YX003 lease lost
--   YX004 idempotency conflict   YX005 waiting for the user
--   YX006 permission denied   YX007 invalid request (names, self-targets)
--   YX008 the tree's sandbox is live on another worker host

-- A 64-bit advisory lock key for a named thing ("session:<id>", ...).
CREATE FUNCTION yuxi.lock_key_v1(p_name text) RETURNS bigint
    LANGUAGE sql IMMUTABLE AS $$
    SELECT ('x' || substr(md5('yuxi.' || p_name), 1, 16))::bit(64)::bigint;
$$;

-- Lock a tree row for the rest of the transaction. Every transition takes it
-- first (lock order: session advisory lock, then tree row, then turn/run rows),
-- which serializes a tree's transitions and keeps event numbers in commit order.
CREATE FUNCTION yuxi.lock_tree_v1(p_tree uuid) RETURNS yuxi.trees
    LANGUAGE plpgsql AS $$
DECLARE
    v_tree yuxi.trees;
BEGIN
    SELECT * INTO v_tree FROM yuxi.trees WHERE id = p_tree FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tree % not found', p_tree USING ERRCODE = 'YX002';
    END IF;
    RETURN v_tree;
END;
$$;

-- The tree_id of a watch of every tree (yuxi.event_watches holds one key per
-- watch; no tree has the nil uuid). IMMUTABLE SQL: inlined as a constant.
CREATE FUNCTION yuxi.every_tree_v1() RETURNS uuid
    LANGUAGE sql IMMUTABLE AS $$
    SELECT '00000000-0000-0000-0000-000000000000'::uuid;
$$;

-- Event watches (yuxi.event_watches). A watch of one tree first waits for the
-- tree's writers in flight (FOR SHARE conflicts with their FOR UPDATE of the
-- tree row): a writer that committed before the watch did is read by the
-- watcher's first read after this commits, and every later writer takes
-- the tree lock after the watch committed, so its check (a new snapshot,
-- after the lock) sees it and it notifies. `p_tree` NULL watches every tree
-- (an operator's psql session): writers in flight meanwhile may commit
-- without a notification, so read after watching.
CREATE FUNCTION yuxi.watch_events_v1(p_tree uuid, p_pid integer DEFAULT pg_backend_pid())
    RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF p_tree IS NOT NULL THEN
        PERFORM 1 FROM yuxi.trees WHERE id = p_tree FOR SHARE;
    END IF;
    INSERT INTO yuxi.event_watches (tree_id, pid)
    VALUES (coalesce(p_tree, yuxi.every_tree_v1()), p_pid)
    ON CONFLICT DO NOTHING;
END;
$$;

CREATE FUNCTION yuxi.unwatch_events_v1(p_tree uuid, p_pid integer DEFAULT pg_backend_pid())
    RETURNS void
    LANGUAGE sql AS $$
    DELETE FROM yuxi.event_watches
     WHERE tree_id = coalesce(p_tree, yuxi.every_tree_v1()) AND pid = p_pid;
$$;

-- Watches of backends that are gone (a listener that lost its connection, a
-- psql session that ended): they only cost notifications nobody reads.
-- `p_pid`: a backend whose watches go too (a listener's previous connection).
CREATE FUNCTION yuxi.forget_watches_v1(p_pid integer DEFAULT NULL) RETURNS integer
    LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM yuxi.event_watches w
         WHERE w.pid = p_pid
            OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = w.pid)
        RETURNING 1)
    SELECT count(*)::integer FROM gone;
$$;

-- Whether a tree's event transactions notify `yuxi_events` (and deltas go out).
-- PL/pgSQL, not SQL: a SQL function with a sub-select is never inlined, and
-- was planned again at each call (22 us, six times a turn); this plan is
-- cached for the session.
CREATE FUNCTION yuxi.events_watched_v1(p_tree uuid) RETURNS boolean
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM yuxi.event_watches
                    WHERE tree_id IN (p_tree, yuxi.every_tree_v1()));
END;
$$;

-- The types of events that waits look at (match_waits_v1): a turn reaching
-- a terminal or waiting state, a message sent.
CREATE FUNCTION yuxi.event_wakes_waits_v1(p_type text) RETURNS boolean
    LANGUAGE sql IMMUTABLE AS $$
    SELECT p_type IN ('turn.completed', 'turn.failed', 'turn.cancelled', 'turn.waiting',
                      'turn.waiting_user', 'message.sent');
$$;

-- Append an event with the tree's next sequence number and notify listeners
-- of the tree when it is watched (delivered at commit; the payload is the
-- tree id only, so the events of one transaction make one notification).
-- The number is the tree's last one + 1, read under the tree row lock that
-- every writer holds until it commits: numbers are gap-free and commit in
-- order, and the tree row is only locked, never rewritten, per event.
-- (Without the lock a concurrent writer would read the same last number,
-- wait on the primary key, and fail once the first commits.) A non-null
-- dedupe_key that was already recorded in this tree makes this a no-op
-- returning NULL: a step re-executed after a crash reports its fact once,
-- and no sequence number is skipped.
CREATE FUNCTION yuxi.emit_event_v1(
    p_tree uuid, p_session uuid, p_turn uuid, p_run uuid,
    p_type text, p_data jsonb DEFAULT '{}', p_dedupe_key text DEFAULT NULL
) RETURNS bigint
    LANGUAGE plpgsql AS $$
DECLARE
    v_tree yuxi.trees;
    v_seq bigint;
BEGIN
    v_tree := yuxi.lock_tree_v1(p_tree);
    IF p_dedupe_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM yuxi.events WHERE tree_id = p_tree AND dedupe_key = p_dedupe_key) THEN
        RETURN NULL;
    END IF;
    SELECT coalesce(max(seq), 0) + 1 INTO v_seq FROM yuxi.events WHERE tree_id = p_tree;
    INSERT INTO yuxi.events (tree_id, seq, user_id, app_id, session_id, turn_id, run_id,
                             type, data, dedupe_key)
    VALUES (p_tree, v_seq, v_tree.user_id, v_tree.app_id, p_session, p_turn, p_run,
            p_type, coalesce(p_data, '{}'), p_dedupe_key);
    IF yuxi.events_watched_v1(p_tree) THEN
        PERFORM pg_notify('yuxi_events', p_tree::text);
    END IF;
    IF p_type IN ('turn.completed', 'turn.failed', 'turn.cancelled') THEN
        -- Who waits for a turn's end (`?wait` of an input or a result) is
        -- woken by the turn's own notification, not by each commit of its
        -- tree.
        PERFORM pg_notify('yuxi_turns', p_turn::text);
    END IF;
    -- Facts that waits look at wake them in this same transaction.
    IF yuxi.event_wakes_waits_v1(p_type) THEN
        PERFORM yuxi.match_waits_v1(p_tree, p_session, p_turn, p_type, p_data);
    END IF;
    RETURN v_seq;
END;
$$;

-- Append a batch of events to a tree: emit_event_v1's rule, set-based
-- (issue 15: a fan-out's 64 tool events, or its children's 192, in one
-- insert instead of one pass each): the tree's next numbers in the given
-- order under its lock, a dedupe key already recorded (or given twice)
-- skipped without a gap, one notification. Only for events no wait looks
-- at: those go through emit_event_v1, which wakes the waits. `p_events`: a
-- JSON array of {session_id, turn_id, run_id, type, data, dedupe_key}.
CREATE FUNCTION yuxi.emit_events_v1(p_tree uuid, p_events jsonb) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_tree yuxi.trees;
    v_type text;
    v_seq bigint;
BEGIN
    SELECT e->>'type' INTO v_type FROM jsonb_array_elements(p_events) e
     WHERE yuxi.event_wakes_waits_v1(e->>'type') LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'a % event wakes waits: emit it with emit_event_v1', v_type
            USING ERRCODE = 'YX007';
    END IF;
    v_tree := yuxi.lock_tree_v1(p_tree);
    SELECT coalesce(max(seq), 0) INTO v_seq FROM yuxi.events WHERE tree_id = p_tree;
    INSERT INTO yuxi.events (tree_id, seq, user_id, app_id, session_id, turn_id, run_id, type,
                             data, dedupe_key)
    SELECT p_tree, v_seq + row_number() OVER (ORDER BY e.o), v_tree.user_id, v_tree.app_id,
           (e.value->>'session_id')::uuid, (e.value->>'turn_id')::uuid,
           (e.value->>'run_id')::uuid, e.value->>'type', coalesce(e.value->'data', '{}'), e.key
      FROM (SELECT DISTINCT ON (coalesce(x.value->>'dedupe_key', x.o::text))
                   x.value, x.o, x.value->>'dedupe_key' AS key
              FROM jsonb_array_elements(p_events) WITH ORDINALITY x(value, o)
             ORDER BY coalesce(x.value->>'dedupe_key', x.o::text), x.o) e
     WHERE e.key IS NULL OR NOT EXISTS (SELECT 1 FROM yuxi.events d
                                         WHERE d.tree_id = p_tree AND d.dedupe_key = e.key);
    IF FOUND AND yuxi.events_watched_v1(p_tree) THEN
        PERFORM pg_notify('yuxi_events', p_tree::text);
    END IF;
END;
$$;

-- Event retention (`yuxi events prune --before T`): a tree's events created
-- before T go, except
--   * its last event: numbers continue from it (the next is max(seq) + 1),
--     so a reader's cursor never sees a number twice;
--   * the facts waits consume (session_updates_v1: turns reaching a terminal
--     or waiting state, messages sent): wait_sessions reads them after its
--     own cursor, however old that is;
-- and a live tree (a turn not yet terminal) keeps everything: its replays and
-- the dedupe keys of steps that may still re-execute. Events written
-- meanwhile are newer than T and numbered after the horizon read here.
-- Returns the number of events deleted.
CREATE FUNCTION yuxi.prune_tree_events_v1(p_tree uuid, p_before timestamptz) RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    v_horizon bigint;
    v_count integer;
BEGIN
    IF EXISTS (SELECT 1 FROM yuxi.turns WHERE tree_id = p_tree
                AND status NOT IN ('completed', 'failed', 'cancelled')) THEN
        RETURN 0;
    END IF;
    SELECT least(min(seq) FILTER (WHERE created_at >= p_before), max(seq)) INTO v_horizon
      FROM yuxi.events WHERE tree_id = p_tree;
    DELETE FROM yuxi.events
     WHERE tree_id = p_tree AND seq < v_horizon
       AND type NOT IN ('turn.completed', 'turn.failed', 'turn.cancelled', 'turn.waiting',
                        'turn.waiting_user', 'message.sent');
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;
