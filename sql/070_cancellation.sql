-- Cancellation: a turn is cancelled exactly; history and side effects that
-- already happened stay. A queued turn ends at once. A turn whose run is
-- executing gets the intent (turns.cancel_requested_at) and its worker
-- converges at the next model or tool boundary. Anything else in flight goes
-- to `cancelling`: its checkpoint is cleaned by the `cleanup_turn` job (the
-- checkpoint-only graph, three commits, each safe to retry), then
-- finish_cancel_v1 ends it `cancelled`.
--
-- A paused queue (sessions.queue_paused) keeps its queued turns queued until
-- "continue". Two things pause it, both through pause_queue_v1 and both in
-- the transaction that records their cancel intents: "stop all" (every
-- member) and the cancel of a turn that was waiting (`waiting` or
-- `waiting_user`: the person is reconsidering, so the work queued behind it
-- must not start on its own). Only continue_queue_v1 opens it again; the
-- cleanup never touches it, so a continue that commits while the turn is
-- still `cancelling` stands.

-- Pause a session's queue. Emits `queue.paused` ({reason}) when it was open;
-- returns whether it was. Caller holds the tree.
CREATE FUNCTION yuxi.pause_queue_v1(p_session uuid, p_turn uuid, p_reason text) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    v_tree uuid;
BEGIN
    UPDATE yuxi.sessions SET queue_paused = true WHERE id = p_session AND NOT queue_paused
    RETURNING tree_id INTO v_tree;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM yuxi.emit_event_v1(v_tree, p_session, p_turn, NULL, 'queue.paused',
                               jsonb_build_object('reason', p_reason));
    RETURN true;
END;
$$;

-- Defer the cleanup job of a cancelling turn (one at a time per turn).
CREATE FUNCTION yuxi.defer_cleanup_v1(p_turn uuid) RETURNS void
    LANGUAGE plpgsql
    SET search_path = procrastinate, pg_catalog
AS $$
BEGIN
    BEGIN
        PERFORM procrastinate_defer_jobs_v1(ARRAY[ROW(
            'maintenance', 'cleanup_turn', 0, 'turn:' || p_turn, 'turn:' || p_turn,
            jsonb_build_object('turn_id', p_turn), NULL)::procrastinate_job_to_defer_v1]);
    EXCEPTION WHEN unique_violation THEN
        NULL;  -- a cleanup of this turn is already waiting
    END;
END;
$$;

-- Put an in-flight turn whose run is not executing into `cancelling`: its
-- live run (pending or ready) and its pending wait are cancelled, its slot
-- goes to the FIFO, and the cleanup job is deferred. Caller holds the tree.
CREATE FUNCTION yuxi.enter_cancelling_v1(p_turn uuid) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_turn yuxi.turns;
    v_run uuid;
BEGIN
    SELECT * INTO v_turn FROM yuxi.turns WHERE id = p_turn;
    FOR v_run IN SELECT id FROM yuxi.runs
                  WHERE turn_id = p_turn AND status IN ('pending', 'ready') FOR UPDATE LOOP
        UPDATE yuxi.runs SET status = 'cancelled', finished_at = now() WHERE id = v_run;
        PERFORM yuxi.release_slot_v1(v_run);
    END LOOP;
    UPDATE yuxi.waits SET status = 'cancelled', reason = 'cancel', resolved_at = now()
     WHERE turn_id = p_turn AND status = 'pending';
    UPDATE yuxi.turns SET status = 'cancelling',
                          cancel_requested_at = coalesce(cancel_requested_at, now())
     WHERE id = p_turn;
    PERFORM yuxi.emit_event_v1(v_turn.tree_id, v_turn.session_id, p_turn, NULL,
                               'turn.cancelling', '{}');
    PERFORM yuxi.defer_cleanup_v1(p_turn);
END;
$$;

-- Cancel exactly one turn (a user through the API, or a session through the
-- cancel_turn tool; scope-checked: the turn must belong to `p_session` of the
-- user and app). Returns what happened: cancelled, cancelling,
-- cancel_requested, or the status of a turn that had already ended. A turn
-- found `waiting` or `waiting_user` (under the tree lock) also pauses its
-- session's queue, in this transaction; a queued or running one does not.
-- An answer and this cancel serialize on the tree row: the answer that
-- commits first makes the turn `running` again (this is then a running
-- turn's cancel, no pause); the cancel that commits first makes the answer
-- fail with YX001.
CREATE FUNCTION yuxi.cancel_turn_v1(p_user uuid, p_app uuid, p_session uuid, p_turn uuid)
RETURNS text
    LANGUAGE plpgsql AS $$
DECLARE
    v_turn yuxi.turns;
BEGIN
    SELECT * INTO v_turn FROM yuxi.turns
     WHERE id = p_turn AND session_id = coalesce(p_session, session_id)
       AND user_id = p_user AND app_id = p_app;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'turn % not found', p_turn USING ERRCODE = 'YX002';
    END IF;
    PERFORM yuxi.lock_tree_v1(v_turn.tree_id);
    SELECT * INTO v_turn FROM yuxi.turns WHERE id = p_turn FOR UPDATE;
    IF v_turn.status = 'queued' THEN
        UPDATE yuxi.turns SET status = 'cancelled', finished_at = now(),
                              cancel_requested_at = now() WHERE id = p_turn;
        UPDATE yuxi.inputs SET status = 'cancelled', finished_at = now()
         WHERE turn_id = p_turn AND status IN ('queued', 'started');
        PERFORM yuxi.emit_event_v1(v_turn.tree_id, v_turn.session_id, p_turn, NULL,
                                   'turn.cancelled', jsonb_build_object('input_id', v_turn.input_id));
        RETURN 'cancelled';
    END IF;
    IF v_turn.status IN ('completed', 'failed', 'cancelled', 'cancelling') THEN
        RETURN v_turn.status;
    END IF;
    IF EXISTS (SELECT 1 FROM yuxi.runs WHERE turn_id = p_turn AND status = 'running') THEN
        -- Its worker converges at the next model or tool boundary.
        UPDATE yuxi.turns SET cancel_requested_at = coalesce(cancel_requested_at, now())
         WHERE id = p_turn;
        PERFORM yuxi.emit_event_v1(v_turn.tree_id, v_turn.session_id, p_turn, NULL,
                                   'turn.cancel_requested', '{}');
        RETURN 'cancel_requested';
    END IF;
    PERFORM yuxi.enter_cancelling_v1(p_turn);
    IF v_turn.status IN ('waiting', 'waiting_user') THEN
        PERFORM yuxi.pause_queue_v1(v_turn.session_id, p_turn, 'cancel');
    END IF;
    RETURN 'cancelling';
END;
$$;

-- The executing worker met the cancel intent at a boundary: its run ends
-- `cancelled` (fenced by its lease) and the turn goes to `cancelling`.
CREATE FUNCTION yuxi.cancel_run_v1(p_run uuid, p_token uuid) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
BEGIN
    v_run := yuxi.fence_run_v1(p_run, p_token);
    UPDATE yuxi.runs SET status = 'cancelled', finished_at = now() WHERE id = p_run;
    PERFORM yuxi.release_slot_v1(p_run);
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'run.cancelled', '{}');
    PERFORM yuxi.enter_cancelling_v1(v_run.turn_id);
END;
$$;

-- The cleanup of a cancelling turn is done: the turn ends `cancelled` (its
-- result is its last run, if it had one), its inputs too, and the session's
-- next queued turn starts. Idempotent.
CREATE FUNCTION yuxi.finish_cancel_v1(p_turn uuid) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    v_turn yuxi.turns;
    v_last uuid;
BEGIN
    SELECT * INTO v_turn FROM yuxi.turns WHERE id = p_turn;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM yuxi.lock_tree_v1(v_turn.tree_id);
    SELECT * INTO v_turn FROM yuxi.turns WHERE id = p_turn FOR UPDATE;
    IF v_turn.status <> 'cancelling' THEN
        RETURN false;
    END IF;
    SELECT id INTO v_last FROM yuxi.runs WHERE turn_id = p_turn ORDER BY slot_seq DESC LIMIT 1;
    UPDATE yuxi.turns SET status = 'cancelled', result_run_id = v_last, finished_at = now()
     WHERE id = p_turn;
    UPDATE yuxi.inputs SET status = 'cancelled', finished_at = now(),
                           started_at = coalesce(started_at, now())
     WHERE turn_id = p_turn AND status IN ('queued', 'started');
    PERFORM yuxi.emit_event_v1(v_turn.tree_id, v_turn.session_id, p_turn, v_last,
                               'turn.cancelled', jsonb_build_object('input_id', v_turn.input_id));
    PERFORM yuxi.start_next_turn_v1(v_turn.session_id);
    RETURN true;
END;
$$;

-- "Stop all" (a user action on any member): cancel every in-flight turn of
-- the tree and pause every member's queue, in one transaction under the tree
-- lock. The lock comes first, before the members and turns are read: a
-- member or turn started by a transaction still open (it holds the tree row)
-- is seen once that commits, and cancelled; read without the lock it would be
-- missed and run on. (Pausing an open queue takes the tree lock too, through
-- its queue.paused event; when every queue is paused already, this lock is
-- the only one.)
-- Returns how many turns it cancelled or asked to cancel.
CREATE FUNCTION yuxi.stop_tree_v1(p_user uuid, p_app uuid, p_session uuid) RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    v_session yuxi.sessions;
    v_member uuid;
    v_turn yuxi.turns;
    v_count integer := 0;
BEGIN
    v_session := yuxi.scoped_session_v1(p_session, p_user, p_app);
    PERFORM yuxi.lock_tree_v1(v_session.tree_id);
    FOR v_member IN SELECT id FROM yuxi.sessions WHERE tree_id = v_session.tree_id
                     ORDER BY path LOOP
        PERFORM yuxi.pause_queue_v1(v_member, NULL, 'stop');
    END LOOP;
    FOR v_turn IN SELECT * FROM yuxi.turns
                   WHERE tree_id = v_session.tree_id
                     AND status IN ('running', 'waiting', 'waiting_user')
                   ORDER BY seq LOOP
        PERFORM yuxi.cancel_turn_v1(p_user, p_app, v_turn.session_id, v_turn.id);
        v_count := v_count + 1;
    END LOOP;
    PERFORM yuxi.emit_event_v1(v_session.tree_id, p_session, NULL, NULL, 'tree.stopped',
                               jsonb_build_object('turns', v_count));
    RETURN v_count;
END;
$$;

-- Resume a paused queue: the oldest queued turn starts (if the session is
-- idle). Never revives a cancelled turn. The tree lock comes first, before
-- the session row is written (the lock order of stop_tree_v1): a continue
-- issued after a stop that waits for the tree waits behind it and has the
-- last word. Writing the row first, it would deadlock with that stop, and
-- the old stop's pause would stay. (A stop that already holds the tree is
-- also ordered before a later continue by the session row both write.)
CREATE FUNCTION yuxi.continue_queue_v1(p_user uuid, p_app uuid, p_session uuid) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_session yuxi.sessions;
BEGIN
    v_session := yuxi.scoped_session_v1(p_session, p_user, p_app);
    PERFORM yuxi.lock_tree_v1(v_session.tree_id);
    UPDATE yuxi.sessions SET queue_paused = false WHERE id = p_session;
    PERFORM yuxi.emit_event_v1(v_session.tree_id, p_session, NULL, NULL, 'queue.continued', '{}');
    RETURN (yuxi.start_next_turn_v1(p_session)).started_turn;
END;
$$;

-- Sweep: cancelling turns whose cleanup job was lost get a new one.
CREATE FUNCTION yuxi.redeliver_cleanups_v1(p_older_than interval) RETURNS integer
    LANGUAGE plpgsql
    SET search_path = procrastinate, pg_catalog
AS $$
DECLARE
    v_turn uuid;
    v_count integer := 0;
BEGIN
    FOR v_turn IN
        SELECT t.id FROM yuxi.turns t
         WHERE t.status = 'cancelling' AND t.cancel_requested_at < now() - p_older_than
           AND NOT EXISTS (SELECT 1 FROM procrastinate_jobs j
                            WHERE j.queueing_lock = 'turn:' || t.id AND j.status IN ('todo', 'doing')
                              AND (j.status = 'todo' OR j.worker_id IS NOT NULL))
    LOOP
        PERFORM yuxi.defer_cleanup_v1(v_turn);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END;
$$;
