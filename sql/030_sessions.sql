-- Sessions, inputs and turns: receiving work and starting turns in FIFO order.

-- The key of a session's advisory lock: receiving an input and updating the
-- session's config hold it, so an input never sees a half-applied update.
CREATE FUNCTION yuxi.session_lock_key_v1(p_session uuid) RETURNS bigint
    LANGUAGE sql IMMUTABLE AS $$
    SELECT yuxi.lock_key_v1('session:' || p_session::text);
$$;

-- The session `p_session` if it belongs to the user and app; YX002 otherwise
-- (another scope's session does not exist for the caller).
CREATE FUNCTION yuxi.scoped_session_v1(p_session uuid, p_user uuid, p_app uuid)
RETURNS yuxi.sessions
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_session yuxi.sessions;
BEGIN
    SELECT * INTO v_session FROM yuxi.sessions
     WHERE id = p_session AND user_id = p_user AND app_id = p_app;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session % not found', p_session USING ERRCODE = 'YX002';
    END IF;
    RETURN v_session;
END;
$$;

-- Create a root session (and its tree) with a fully resolved config snapshot.
CREATE FUNCTION yuxi.create_root_session_v1(
    p_user uuid, p_app uuid, p_agent uuid, p_title text, p_config jsonb
) RETURNS yuxi.sessions
    LANGUAGE plpgsql AS $$
DECLARE
    v_id uuid := gen_random_uuid();
    v_session yuxi.sessions;
BEGIN
    INSERT INTO yuxi.trees (id, user_id, app_id) VALUES (v_id, p_user, p_app);
    INSERT INTO yuxi.sessions (id, tree_id, parent_id, user_id, app_id, agent_id,
                               name, path, title, config)
    VALUES (v_id, v_id, NULL, p_user, p_app, p_agent, 'root', '/root', p_title, p_config)
    RETURNING * INTO v_session;
    PERFORM yuxi.emit_event_v1(v_id, v_id, NULL, NULL, 'session.created',
                               jsonb_build_object('path', v_session.path, 'title', p_title));
    RETURN v_session;
END;
$$;

-- Create the first run of a turn that has just become `running` (the caller
-- holds the tree lock and passes the tree row): ready with a slot and a job
-- when the tree has a slot free and no run waiting (as claim_slot_v1 would
-- decide, written once), else pending in the tree FIFO. A run that gets its
-- slot while a completing worker's hand-over offer is open
-- (take_hand_over_v1, sql/020_slots.sql) is created running, leased to that
-- worker: it goes on with it, no job. Each run is written once, in its final
-- state. Emits turn.started (and run.started when leased). Returns the run
-- when it was handed over, NULL otherwise.
CREATE FUNCTION yuxi.start_turn_run_v1(p_turn yuxi.turns, p_tree yuxi.trees, p_config jsonb)
RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_run uuid := gen_random_uuid();
    v_ready boolean := yuxi.free_slots_v1(p_tree) > 0;
    v_token uuid := CASE WHEN v_ready THEN yuxi.take_hand_over_v1(p_tree.id, v_run) END;
    v_host text := CASE WHEN v_token IS NOT NULL THEN yuxi.hand_over_host_v1() END;
    v_claimer integer := CASE WHEN v_token IS NOT NULL THEN yuxi.hand_over_claimer_v1() END;
    v_row yuxi.runs;
BEGIN
    INSERT INTO yuxi.runs (id, turn_id, session_id, tree_id, user_id, app_id, config, status,
                           lease_token, lease_expires_at, started_at, host_id, claimer)
    VALUES (v_run, p_turn.id, p_turn.session_id, p_turn.tree_id, p_turn.user_id, p_turn.app_id,
            p_config,
            CASE WHEN v_token IS NOT NULL THEN 'running' WHEN v_ready THEN 'ready'
                 ELSE 'pending' END,
            v_token,
            CASE WHEN v_token IS NOT NULL THEN yuxi.hand_over_lease_expiry_v1() END,
            CASE WHEN v_token IS NOT NULL THEN now() END,
            v_host, v_claimer)
    RETURNING * INTO v_row;
    IF v_ready THEN
        INSERT INTO yuxi.slot_claims (run_id, tree_id) VALUES (v_run, p_turn.tree_id);
        IF v_token IS NULL THEN
            PERFORM yuxi.defer_run_job_v1(v_run);
        END IF;
    END IF;
    PERFORM yuxi.emit_event_v1(p_turn.tree_id, p_turn.session_id, p_turn.id, v_run,
                               'turn.started', jsonb_build_object('input_id', p_turn.input_id));
    IF v_token IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM yuxi.emit_run_started_v1(v_row, 'handed_over');
    RETURN v_run;
END;
$$;

-- Start the session's oldest queued turn if nothing is in flight and its
-- queue is not paused: the turn runs and its first run is created with the
-- input's frozen config (start_turn_run_v1: it may be handed over to a
-- completing worker). Returns the started turn (NULL when none) and its run
-- when that was handed over. Caller holds the tree lock or not; it is taken
-- here first either way.
CREATE FUNCTION yuxi.start_next_turn_v1(p_session uuid,
                                        OUT started_turn uuid, OUT leased_run uuid)
    LANGUAGE plpgsql AS $$
DECLARE
    v_session yuxi.sessions;
    v_tree yuxi.trees;
    v_turn yuxi.turns;
    v_snapshot jsonb;
BEGIN
    SELECT * INTO v_session FROM yuxi.sessions WHERE id = p_session;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session % not found', p_session USING ERRCODE = 'YX002';
    END IF;
    v_tree := yuxi.lock_tree_v1(v_session.tree_id);
    SELECT queue_paused INTO v_session.queue_paused FROM yuxi.sessions WHERE id = p_session;
    IF v_session.queue_paused OR EXISTS (
        SELECT 1 FROM yuxi.turns WHERE session_id = p_session
          AND status IN ('running', 'waiting', 'waiting_user', 'cancelling')) THEN
        RETURN;
    END IF;
    SELECT * INTO v_turn FROM yuxi.turns
        WHERE session_id = p_session AND status = 'queued'
        ORDER BY seq LIMIT 1 FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE yuxi.turns SET status = 'running', started_at = now() WHERE id = v_turn.id;
    UPDATE yuxi.inputs SET status = 'started', started_at = now()
        WHERE id = v_turn.input_id
        RETURNING context_snapshot INTO v_snapshot;
    started_turn := v_turn.id;
    leased_run := yuxi.start_turn_run_v1(v_turn, v_tree, v_snapshot);
END;
$$;

-- Durably receive an input (one transaction, under the session advisory
-- lock): idempotent on client_request_id, freezes the session config with the
-- one-off overrides into the input. A `steer` input while a turn is in flight
-- joins that turn (delivered at its next model boundary, with its run's
-- config); otherwise the input gets its own turn, queued FIFO and started at
-- once when the session is idle. A session waiting for its user refuses new
-- input (YX005). Returns the input id; a replayed client_request_id returns
-- the first input's id and writes nothing.
CREATE FUNCTION yuxi.receive_input_v1(
    p_session uuid, p_user uuid, p_app uuid, p_content text, p_mode text,
    p_overrides jsonb, p_client_request_id text, p_by_user boolean DEFAULT false
) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_session yuxi.sessions;
    v_tree yuxi.trees;
    v_active yuxi.turns;
    v_new_turn yuxi.turns;
    v_input uuid;
    v_turn uuid;
    v_steer boolean;
    v_start boolean;
    v_snapshot jsonb;
BEGIN
    v_session := yuxi.scoped_session_v1(p_session, p_user, p_app);
    PERFORM pg_advisory_xact_lock(yuxi.session_lock_key_v1(p_session));
    v_tree := yuxi.lock_tree_v1(v_session.tree_id);
    IF p_client_request_id IS NOT NULL THEN
        SELECT id INTO v_input FROM yuxi.inputs
            WHERE session_id = p_session AND client_request_id = p_client_request_id;
        IF FOUND THEN
            -- The same key with another request is a client bug: refuse it.
            IF NOT EXISTS (SELECT 1 FROM yuxi.inputs WHERE id = v_input
                             AND content = p_content AND mode = p_mode) THEN
                RAISE EXCEPTION 'client_request_id % was already used for another input',
                    p_client_request_id USING ERRCODE = 'YX004';
            END IF;
            RETURN v_input;
        END IF;
    END IF;
    SELECT * INTO v_active FROM yuxi.turns
        WHERE session_id = p_session
          AND status IN ('running', 'waiting', 'waiting_user', 'cancelling');
    IF v_active.status = 'waiting_user' THEN
        RAISE EXCEPTION 'session % is waiting for its user to answer turn %', p_session, v_active.id
            USING ERRCODE = 'YX005';
    END IF;
    -- Re-read the config under the lock: an update that committed while we
    -- waited must be in the snapshot, never half of it.
    SELECT * INTO v_session FROM yuxi.sessions WHERE id = p_session;
    IF p_by_user AND v_session.parent_id IS NOT NULL THEN
        -- A person acted on a member directly: its parent gets a notice.
        PERFORM yuxi.emit_event_v1(v_session.tree_id, v_session.parent_id, NULL, NULL,
                                   'member.user_input',
                                   jsonb_build_object('session_id', p_session,
                                                      'path', v_session.path, 'mode', p_mode));
    END IF;
    -- The input is written with its turn (the turn's row follows: the FK to
    -- it is checked at commit): a steer joins the turn in flight, anything
    -- else gets a new turn.
    v_steer := p_mode = 'steer' AND coalesce(v_active.status IN ('running', 'waiting'), false);
    v_turn := CASE WHEN v_steer THEN v_active.id ELSE gen_random_uuid() END;
    -- An idle session with nothing queued before it (and its queue not
    -- paused) starts the new turn at once: input and turn are written
    -- started, in their final state, instead of queued and then updated.
    v_start := NOT v_steer AND v_active.id IS NULL AND NOT v_session.queue_paused
               AND NOT EXISTS (SELECT 1 FROM yuxi.turns
                               WHERE session_id = p_session AND status = 'queued');
    v_snapshot := v_session.config || coalesce(p_overrides, '{}');
    INSERT INTO yuxi.inputs (session_id, tree_id, user_id, app_id, content, mode,
                             client_request_id, context_snapshot, turn_id, status, started_at)
    VALUES (p_session, v_session.tree_id, p_user, p_app, p_content, p_mode,
            p_client_request_id, v_snapshot, v_turn,
            CASE WHEN v_start THEN 'started' ELSE 'queued' END,
            CASE WHEN v_start THEN now() END)
    RETURNING id INTO v_input;
    IF v_steer THEN
        PERFORM yuxi.emit_event_v1(v_session.tree_id, p_session, v_active.id, NULL,
                                   'input.received',
                                   jsonb_build_object('input_id', v_input, 'mode', p_mode,
                                                      'steer', true));
        -- A turn waiting for cooperation resumes to take the steer in.
        PERFORM yuxi.resolve_wait_v1(w.id, 'steer', v_session.tree_id)
           FROM yuxi.waits w WHERE w.turn_id = v_active.id AND w.status = 'pending';
        RETURN v_input;
    END IF;
    INSERT INTO yuxi.turns (id, session_id, tree_id, user_id, app_id, input_id, status,
                            started_at)
    VALUES (v_turn, p_session, v_session.tree_id, p_user, p_app, v_input,
            CASE WHEN v_start THEN 'running' ELSE 'queued' END,
            CASE WHEN v_start THEN now() END)
    RETURNING * INTO v_new_turn;
    PERFORM yuxi.emit_event_v1(v_session.tree_id, p_session, v_turn, NULL, 'input.received',
                               jsonb_build_object('input_id', v_input, 'mode', p_mode,
                                                  'steer', false));
    -- A turn in flight (found above, under the locks) keeps the new one
    -- queued; an idle session whose open queue holds older turns starts the
    -- oldest (a paused queue stays as it is).
    IF v_start THEN
        PERFORM yuxi.start_turn_run_v1(v_new_turn, v_tree, v_snapshot);
    ELSIF v_active.id IS NULL THEN
        PERFORM yuxi.start_next_turn_v1(p_session);
    END IF;
    RETURN v_input;
END;
$$;

-- receive_input_v1 and the receipt the API answers with, in one statement
-- (its own transaction): the input, its turn and its place in the queue.
CREATE FUNCTION yuxi.receive_input_receipt_v1(
    p_session uuid, p_user uuid, p_app uuid, p_content text, p_mode text,
    p_overrides jsonb, p_client_request_id text, p_by_user boolean DEFAULT false
) RETURNS TABLE (id uuid, session_id uuid, status text, turn_id uuid, mode text,
                 "position" bigint)
    LANGUAGE plpgsql AS $$
DECLARE
    v_input uuid;
BEGIN
    v_input := yuxi.receive_input_v1(p_session, p_user, p_app, p_content, p_mode,
                                     p_overrides, p_client_request_id, p_by_user);
    RETURN QUERY
    SELECT i.id, i.session_id, i.status, i.turn_id, i.mode,
           CASE WHEN t.status = 'queued' THEN
               (SELECT count(*) FROM yuxi.turns q
                 WHERE q.session_id = i.session_id AND q.status = 'queued' AND q.seq < t.seq) + 1
           END
      FROM yuxi.inputs i LEFT JOIN yuxi.turns t ON t.id = i.turn_id
     WHERE i.id = v_input;
END;
$$;

-- Update a session's mutable settings (title, model, approval mode) under the
-- same advisory lock as receive_input: only inputs received afterwards see it.
-- p_changes holds only the keys to change.
CREATE FUNCTION yuxi.update_session_v1(
    p_session uuid, p_user uuid, p_app uuid, p_changes jsonb
) RETURNS yuxi.sessions
    LANGUAGE plpgsql AS $$
DECLARE
    v_session yuxi.sessions;
BEGIN
    PERFORM pg_advisory_xact_lock(yuxi.session_lock_key_v1(p_session));
    UPDATE yuxi.sessions
       SET title = CASE WHEN p_changes ? 'title' THEN p_changes->>'title' ELSE title END,
           config = config || (p_changes - 'title')
     WHERE id = p_session AND user_id = p_user AND app_id = p_app
    RETURNING * INTO v_session;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session % not found', p_session USING ERRCODE = 'YX002';
    END IF;
    PERFORM yuxi.emit_event_v1(v_session.tree_id, p_session, NULL, NULL, 'session.updated',
                               p_changes);
    RETURN v_session;
END;
$$;

-- A page of a scope's root sessions, newest first (GET /api/sessions): the
-- first page without a cursor, later pages after (p_after_created,
-- p_after_id), each its own statement so the keyset is an index condition.
-- The statements run with generic plans (the function's SET): their LIMIT is
-- a parameter, which a generic plan estimates at a tenth of the scope's
-- roots, so PostgreSQL judged it dearer than a custom plan and re-planned
-- the statement at every call (~0.7 ms of a 1.1 ms listing at 9,000 roots,
-- benchmarks/README.md); the generic plan is the same index scan.
CREATE FUNCTION yuxi.list_root_sessions_v1(
    p_user uuid, p_app uuid, p_limit integer,
    p_after_created timestamptz DEFAULT NULL, p_after_id uuid DEFAULT NULL
) RETURNS TABLE (id uuid, tree_id uuid, parent_id uuid, name text, path text, title text,
                 status text, agent_id uuid, model text, approval_mode text,
                 created_at timestamptz, current_turn_id uuid, queue_length bigint,
                 queue_paused boolean)
    LANGUAGE plpgsql STABLE
    SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    IF p_after_created IS NULL THEN
        RETURN QUERY
        SELECT s.id, s.tree_id, s.parent_id, s.name, s.path, s.title, v.status, s.agent_id,
               s.config->>'model', s.config->>'approval_mode',
               s.created_at, v.current_turn_id, v.queue_length, v.queue_paused
          FROM yuxi.sessions s
          JOIN yuxi.session_status_v v ON v.session_id = s.id
         WHERE s.user_id = p_user AND s.app_id = p_app AND s.parent_id IS NULL
         ORDER BY s.created_at DESC, s.id DESC
         LIMIT p_limit;
    ELSE
        RETURN QUERY
        SELECT s.id, s.tree_id, s.parent_id, s.name, s.path, s.title, v.status, s.agent_id,
               s.config->>'model', s.config->>'approval_mode',
               s.created_at, v.current_turn_id, v.queue_length, v.queue_paused
          FROM yuxi.sessions s
          JOIN yuxi.session_status_v v ON v.session_id = s.id
         WHERE s.user_id = p_user AND s.app_id = p_app AND s.parent_id IS NULL
           AND (s.created_at, s.id) < (p_after_created, p_after_id)
         ORDER BY s.created_at DESC, s.id DESC
         LIMIT p_limit;
    END IF;
END;
$$;
