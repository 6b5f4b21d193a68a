-- Cooperation: child sessions, messages, idempotent effects and durable
-- waits. Errors: YX002 not found (also: out of scope), YX004 effect conflict,
-- YX007 invalid cooperation request (bad name, waiting on yourself, ...).

-- The run that created a child session (audit; NULL for roots and children
-- created by a user through the API).
ALTER TABLE yuxi.sessions ADD COLUMN source_run_id uuid REFERENCES yuxi.runs (id);
CREATE INDEX sessions_source_run_idx ON yuxi.sessions (source_run_id) WHERE source_run_id IS NOT NULL;

-- What a resume run hands to the interrupted tool (`Command(resume=...)`).
ALTER TABLE yuxi.runs ADD COLUMN resume jsonb;

-- A cancel intent committed for a turn in flight.
ALTER TABLE yuxi.turns ADD COLUMN cancel_requested_at timestamptz;

-- A cooperation message: sender, receiver, the run that sent it; `seq` is its
-- received position, `processed_run_id` the run whose conversation took it in.
CREATE TABLE yuxi.messages (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    seq bigint GENERATED ALWAYS AS IDENTITY,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    sender_session_id uuid NOT NULL,
    sender_tree_id uuid NOT NULL,
    receiver_session_id uuid NOT NULL,
    receiver_tree_id uuid NOT NULL,
    source_run_id uuid REFERENCES yuxi.runs (id),
    content text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    processed_at timestamptz,
    processed_run_id uuid REFERENCES yuxi.runs (id),
    CONSTRAINT messages_sender_fk FOREIGN KEY (sender_session_id, sender_tree_id, user_id, app_id)
        REFERENCES yuxi.sessions (id, tree_id, user_id, app_id),
    -- Same user and app on both ends: the scope is never widened.
    CONSTRAINT messages_receiver_fk FOREIGN KEY (receiver_session_id, receiver_tree_id, user_id, app_id)
        REFERENCES yuxi.sessions (id, tree_id, user_id, app_id),
    CONSTRAINT messages_content_not_blank CHECK (btrim(content) <> ''),
    CONSTRAINT messages_processed_together CHECK ((processed_at IS NULL) = (processed_run_id IS NULL))
);
CREATE INDEX messages_unprocessed_idx ON yuxi.messages (receiver_session_id, seq)
    WHERE processed_at IS NULL;
CREATE INDEX messages_sender_idx ON yuxi.messages (sender_session_id, sender_tree_id, user_id, app_id);
CREATE INDEX messages_receiver_idx ON yuxi.messages (receiver_session_id, receiver_tree_id, user_id, app_id);

-- The recorded outcome of a side-effecting cooperation tool call, keyed by
-- (source turn, tool call id): a replay through a later run of the same turn
-- returns `result` and does nothing; `first_run_id` stays for audit.
CREATE TABLE yuxi.effects (
    turn_id uuid NOT NULL,
    call_id text NOT NULL,
    session_id uuid NOT NULL,
    tree_id uuid NOT NULL,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    tool text NOT NULL,
    fingerprint text NOT NULL,
    result jsonb NOT NULL,
    first_run_id uuid NOT NULL REFERENCES yuxi.runs (id),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (turn_id, call_id),
    CONSTRAINT effects_turn_fk FOREIGN KEY (turn_id, session_id, tree_id, user_id, app_id)
        REFERENCES yuxi.turns (id, session_id, tree_id, user_id, app_id)
);
CREATE INDEX effects_owner_idx ON yuxi.effects (turn_id, session_id, tree_id, user_id, app_id);

-- A persisted wake-up condition of a suspended run.
CREATE TABLE yuxi.waits (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    run_id uuid NOT NULL UNIQUE,
    turn_id uuid NOT NULL,
    session_id uuid NOT NULL,
    tree_id uuid NOT NULL,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    kind text NOT NULL,
    targets uuid[] NOT NULL,
    cursor jsonb NOT NULL DEFAULT '{}',
    deadline timestamptz NOT NULL,
    status text NOT NULL DEFAULT 'pending',
    reason text,
    resume_run_id uuid REFERENCES yuxi.runs (id),
    created_at timestamptz NOT NULL DEFAULT now(),
    resolved_at timestamptz,
    CONSTRAINT waits_run_same_turn_fk FOREIGN KEY (run_id, turn_id) REFERENCES yuxi.runs (id, turn_id),
    CONSTRAINT waits_turn_fk FOREIGN KEY (turn_id, session_id, tree_id, user_id, app_id)
        REFERENCES yuxi.turns (id, session_id, tree_id, user_id, app_id),
    CONSTRAINT waits_kind_known CHECK (kind IN ('sessions', 'inputs')),
    CONSTRAINT waits_has_targets CHECK (cardinality(targets) > 0),
    CONSTRAINT waits_not_on_self CHECK (kind <> 'sessions' OR NOT (session_id = ANY(targets))),
    CONSTRAINT waits_status_known CHECK (status IN ('pending', 'satisfied', 'timed_out', 'cancelled')),
    CONSTRAINT waits_resolved_iff_not_pending CHECK ((resolved_at IS NULL) = (status = 'pending'))
);
CREATE UNIQUE INDEX waits_one_pending_per_turn ON yuxi.waits (turn_id) WHERE status = 'pending';
CREATE INDEX waits_pending_targets_idx ON yuxi.waits USING gin (targets) WHERE status = 'pending';
CREATE INDEX waits_owner_idx ON yuxi.waits (turn_id, session_id, tree_id, user_id, app_id);
CREATE INDEX waits_pending_deadline_idx ON yuxi.waits (deadline) WHERE status = 'pending';

-- Resolve a session reference of a caller: a session id of the caller's user
-- and app, or a path in the caller's tree ("/root/x"), or a name relative to
-- the caller ("x" is the caller's child). Paths only locate; scope decides.
CREATE FUNCTION yuxi.resolve_session_v1(p_caller uuid, p_ref text) RETURNS yuxi.sessions
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_caller yuxi.sessions;
    v_target yuxi.sessions;
BEGIN
    SELECT * INTO v_caller FROM yuxi.sessions WHERE id = p_caller;
    IF p_ref ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
        SELECT * INTO v_target FROM yuxi.sessions
         WHERE id = p_ref::uuid AND user_id = v_caller.user_id AND app_id = v_caller.app_id;
    ELSIF left(p_ref, 1) = '/' THEN
        SELECT * INTO v_target FROM yuxi.sessions
         WHERE tree_id = v_caller.tree_id AND path = p_ref;
    ELSE
        SELECT * INTO v_target FROM yuxi.sessions
         WHERE tree_id = v_caller.tree_id AND path = v_caller.path || '/' || p_ref;
    END IF;
    IF v_target.id IS NULL THEN
        RAISE EXCEPTION 'no session % visible to this session', p_ref USING ERRCODE = 'YX002';
    END IF;
    RETURN v_target;
END;
$$;

-- Look up the effect of (turn, call). Returns its result when the same
-- request was recorded, NULL when there is none; a different request under
-- the same key is refused (YX004).
CREATE FUNCTION yuxi.find_effect_v1(p_turn uuid, p_call_id text, p_tool text, p_fingerprint text)
RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    v_effect yuxi.effects;
BEGIN
    SELECT * INTO v_effect FROM yuxi.effects WHERE turn_id = p_turn AND call_id = p_call_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF v_effect.tool <> p_tool OR v_effect.fingerprint <> p_fingerprint THEN
        RAISE EXCEPTION 'tool call % of this turn was already recorded with another request',
            p_call_id USING ERRCODE = 'YX004';
    END IF;
    RETURN v_effect.result;
END;
$$;

-- Record an effect (in the transaction that performed it).
CREATE FUNCTION yuxi.record_effect_v1(
    p_run uuid, p_call_id text, p_tool text, p_fingerprint text, p_result jsonb
) RETURNS jsonb
    -- plpgsql, not sql: a SQL function that cannot be inlined is parsed and
    -- planned again at every call (each effect of a tool call makes one).
    LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO yuxi.effects (turn_id, call_id, session_id, tree_id, user_id, app_id, tool,
                              fingerprint, result, first_run_id)
    SELECT turn_id, p_call_id, session_id, tree_id, user_id, app_id, p_tool, p_fingerprint,
           p_result, id
      FROM yuxi.runs WHERE id = p_run;
    RETURN CASE WHEN FOUND THEN p_result END;
END;
$$;

-- Create children of the session whose run dispatches them, each with a
-- frozen config and its first input (exactly its task text), set-based: a
-- fan-out's batch of creates holds the tree's lock for a few statements, not
-- for some twenty per child (issue 15: the tree's other runs wait on that
-- lock). `p_children`: a JSON array of {name, title, task}. A new child has
-- no turn in flight, none queued, no request key and an open queue, so each
-- input is written started with its running turn, as receive_input_v1 would
-- write it; its run takes one of the tree's free slots in order (ready, with
-- its job) or waits pending in the tree FIFO, as start_turn_run_v1 would
-- decide child by child (no hand-over offer is open in a create's
-- transaction). Events per child, in order: session.created,
-- input.received, turn.started. Returns the children in the given order.
CREATE FUNCTION yuxi.create_children_v1(p_parent uuid, p_source_run uuid, p_agent uuid,
                                        p_config jsonb, p_children jsonb)
RETURNS TABLE (ord bigint, session_id uuid, name text, path text, input_id uuid,
               turn_id uuid)
    LANGUAGE plpgsql AS $$
DECLARE
    v_parent yuxi.sessions;
    v_tree yuxi.trees;
    v_found boolean;
    v_bad text;
    v_free integer;
    v_made jsonb;
    v_runs uuid[] := ARRAY(SELECT gen_random_uuid()
                             FROM generate_series(1, jsonb_array_length(p_children)));
    v_run uuid;
BEGIN
    SELECT true, c.value->>'name' INTO v_found, v_bad FROM jsonb_array_elements(p_children) c
     WHERE coalesce(c.value->>'name', '') !~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'
        OR c.value->>'name' IN ('.', '..')
     LIMIT 1;
    IF v_found THEN
        RAISE EXCEPTION 'invalid session name %: use 1-64 letters, digits, ".", "_" or "-", '
            'starting with a letter or digit (a name, not a path)', coalesce(v_bad, 'NULL')
            USING ERRCODE = 'YX007';
    END IF;
    SELECT * INTO v_parent FROM yuxi.sessions WHERE id = p_parent;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session % not found', p_parent USING ERRCODE = 'YX002';
    END IF;
    v_tree := yuxi.lock_tree_v1(v_parent.tree_id);
    -- A name taken, or given twice in the batch.
    SELECT c.name INTO v_bad
      FROM (SELECT x.value->>'name' AS name, x.o, count(*) OVER (PARTITION BY x.value->>'name') AS n
              FROM jsonb_array_elements(p_children) WITH ORDINALITY x(value, o)) c
     WHERE c.n > 1 OR EXISTS (SELECT 1 FROM yuxi.sessions s WHERE s.tree_id = v_parent.tree_id
                                 AND s.path = v_parent.path || '/' || c.name)
     ORDER BY c.o LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'session % already has a child named %', v_parent.path, v_bad
            USING ERRCODE = 'YX007';
    END IF;
    -- As start_turn_run_v1 would decide child by child: the first ones take
    -- the free slots; once one waits, every later one queues behind it.
    v_free := yuxi.free_slots_v1(v_tree);
    -- One statement: the sub-statements' foreign keys are checked at its end.
    -- Identity columns (the FIFOs' seq, slot_seq) follow the given order.
    WITH c AS MATERIALIZED (
        SELECT x.o AS ord, x.value->>'name' AS name, x.value->>'title' AS title,
               x.value->>'task' AS task, v_parent.path || '/' || (x.value->>'name') AS path,
               gen_random_uuid() AS sid, gen_random_uuid() AS iid, gen_random_uuid() AS tid,
               v_runs[x.o] AS rid, x.o <= v_free AS ready
          FROM jsonb_array_elements(p_children) WITH ORDINALITY x(value, o)),
    s AS (INSERT INTO yuxi.sessions (id, tree_id, parent_id, user_id, app_id, agent_id, name,
                                     path, title, config, source_run_id)
          SELECT c.sid, v_tree.id, p_parent, v_parent.user_id, v_parent.app_id, p_agent, c.name,
                 c.path, c.title, p_config, p_source_run FROM c ORDER BY c.ord),
    i AS (INSERT INTO yuxi.inputs (id, session_id, tree_id, user_id, app_id, content, mode,
                                   context_snapshot, turn_id, status, started_at)
          SELECT c.iid, c.sid, v_tree.id, v_parent.user_id, v_parent.app_id, c.task, 'queue',
                 p_config, c.tid, 'started', now() FROM c ORDER BY c.ord),
    t AS (INSERT INTO yuxi.turns (id, session_id, tree_id, user_id, app_id, input_id, status,
                                  started_at)
          SELECT c.tid, c.sid, v_tree.id, v_parent.user_id, v_parent.app_id, c.iid, 'running',
                 now() FROM c ORDER BY c.ord),
    r AS (INSERT INTO yuxi.runs (id, turn_id, session_id, tree_id, user_id, app_id, config,
                                 status)
          SELECT c.rid, c.tid, c.sid, v_tree.id, v_parent.user_id, v_parent.app_id, p_config,
                 CASE WHEN c.ready THEN 'ready' ELSE 'pending' END FROM c ORDER BY c.ord),
    k AS (INSERT INTO yuxi.slot_claims (run_id, tree_id)
          SELECT c.rid, v_tree.id FROM c WHERE c.ready)
    SELECT jsonb_agg(jsonb_build_object('session_id', c.sid, 'name', c.name, 'path', c.path,
                                        'title', c.title, 'input_id', c.iid, 'turn_id', c.tid,
                                        'run_id', c.rid) ORDER BY c.ord)
      INTO v_made FROM c;
    -- Per child, in order: session.created, input.received, turn.started.
    PERFORM yuxi.emit_events_v1(v_tree.id, (
        SELECT jsonb_agg(jsonb_build_object(
                   'session_id', m.value->'session_id', 'type', v.type,
                   'turn_id', CASE WHEN v.n > 1 THEN m.value->'turn_id' END,
                   'run_id', CASE v.n WHEN 1 THEN to_jsonb(p_source_run)
                                      WHEN 3 THEN m.value->'run_id' END,
                   'data', CASE v.n
                       WHEN 1 THEN jsonb_build_object('path', m.value->'path',
                                                      'title', m.value->'title',
                                                      'parent_id', p_parent)
                       WHEN 2 THEN jsonb_build_object('input_id', m.value->'input_id',
                                                      'mode', 'queue', 'steer', false)
                       ELSE jsonb_build_object('input_id', m.value->'input_id') END)
                   ORDER BY m.o, v.n)
          FROM jsonb_array_elements(v_made) WITH ORDINALITY m(value, o),
               (VALUES (1, 'session.created'), (2, 'input.received'),
                       (3, 'turn.started')) v(n, type)));
    FOREACH v_run IN ARRAY v_runs[1:v_free] LOOP
        PERFORM yuxi.defer_run_job_v1(v_run);
    END LOOP;
    RETURN QUERY SELECT m.o, (m.value->>'session_id')::uuid, m.value->>'name',
                        m.value->>'path', (m.value->>'input_id')::uuid,
                        (m.value->>'turn_id')::uuid
                   FROM jsonb_array_elements(v_made) WITH ORDINALITY m(value, o) ORDER BY m.o;
END;
$$;
-- Create one child (create_children_v1): with an agent's config, or by a
-- user through the API. Returns the child id.
CREATE FUNCTION yuxi.create_child_session_v1(
    p_parent uuid, p_source_run uuid, p_name text, p_title text, p_agent uuid,
    p_config jsonb, p_task text
) RETURNS uuid
    LANGUAGE plpgsql AS $$
BEGIN
    RETURN (SELECT c.session_id
              FROM yuxi.create_children_v1(p_parent, p_source_run, p_agent, p_config,
                                           jsonb_build_array(jsonb_build_object(
                                               'name', p_name, 'title', p_title,
                                               'task', p_task))) c);
END;
$$;

-- The create_session tool's whole effect, for one or more calls of a run's
-- step, in one statement (issue 15): the lease check, the recorded effects
-- of calls already made (a step re-executed after a crash: their results
-- again, nothing new), then the other calls' children (create_children_v1)
-- and their effect records. A fan-out's calls go together (the worker
-- batches them: yuxi.runtime.group_commit), so the tree lock is taken once
-- per batch, never across the worker's round trips. A call that fails fails
-- its batch: the worker then makes each call on its own, so that only that
-- call's tool result is the error. `p_calls`: an array of {call_id,
-- fingerprint, name, title, task}; `p_config`: the children's config (the
-- run's own). Returns the tool results, in order.
CREATE FUNCTION yuxi.create_session_effects_v1(p_run uuid, p_token uuid, p_config jsonb,
                                               p_calls jsonb) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_call text;
    v_new jsonb;
BEGIN
    v_run := yuxi.fence_run_v1(p_run, p_token);
    -- The calls not recorded yet, and find_effect_v1's rule for the others:
    -- the same key with another request is refused.
    SELECT min(c.value->>'call_id') FILTER (
               WHERE e.tool <> 'create_session' OR e.fingerprint <> c.value->>'fingerprint'),
           jsonb_agg(c.value ORDER BY c.o) FILTER (WHERE e.call_id IS NULL)
      INTO v_call, v_new
      FROM jsonb_array_elements(p_calls) WITH ORDINALITY c(value, o)
      LEFT JOIN yuxi.effects e ON e.turn_id = v_run.turn_id
                              AND e.call_id = c.value->>'call_id';
    IF v_call IS NOT NULL THEN
        RAISE EXCEPTION 'tool call % of this turn was already recorded with another request',
            v_call USING ERRCODE = 'YX004';
    END IF;
    IF v_new IS NOT NULL THEN
        INSERT INTO yuxi.effects (turn_id, call_id, session_id, tree_id, user_id, app_id, tool,
                                  fingerprint, result, first_run_id)
        SELECT v_run.turn_id, v_new->(m.ord::int - 1)->>'call_id', v_run.session_id,
               v_run.tree_id, v_run.user_id, v_run.app_id, 'create_session',
               v_new->(m.ord::int - 1)->>'fingerprint',
               jsonb_build_object('session_id', m.session_id, 'name', m.name, 'path', m.path,
                                  'input_id', m.input_id, 'turn_id', m.turn_id),
               p_run
          FROM yuxi.create_children_v1(v_run.session_id, p_run, NULL, p_config, v_new) m;
    END IF;
    RETURN (SELECT jsonb_agg(e.result ORDER BY c.o)
              FROM jsonb_array_elements(p_calls) WITH ORDINALITY c(value, o)
              JOIN yuxi.effects e ON e.turn_id = v_run.turn_id
                                 AND e.call_id = c.value->>'call_id');
END;
$$;

-- Deliver a cooperation message. It creates no turn and wakes nothing but a
-- run waiting on the sender (through the message.sent event). Both trees are
-- locked in id order first, since events are written into both.
CREATE FUNCTION yuxi.send_message_v1(p_source_run uuid, p_receiver uuid, p_content text)
RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_receiver yuxi.sessions;
    v_message uuid;
BEGIN
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_source_run;
    SELECT * INTO v_receiver FROM yuxi.sessions
     WHERE id = p_receiver AND user_id = v_run.user_id AND app_id = v_run.app_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'session % not found', p_receiver USING ERRCODE = 'YX002';
    END IF;
    IF v_receiver.id = v_run.session_id THEN
        RAISE EXCEPTION 'a session cannot message itself' USING ERRCODE = 'YX007';
    END IF;
    PERFORM yuxi.lock_tree_v1(t) FROM unnest(ARRAY[v_run.tree_id, v_receiver.tree_id]) t ORDER BY t;
    INSERT INTO yuxi.messages (user_id, app_id, sender_session_id, sender_tree_id,
                               receiver_session_id, receiver_tree_id, source_run_id, content)
    VALUES (v_run.user_id, v_run.app_id, v_run.session_id, v_run.tree_id, v_receiver.id,
            v_receiver.tree_id, p_source_run, p_content)
    RETURNING id INTO v_message;
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_source_run,
                               'message.sent',
                               jsonb_build_object('message_id', v_message, 'to', v_receiver.id));
    PERFORM yuxi.emit_event_v1(v_receiver.tree_id, v_receiver.id, NULL, NULL, 'message.received',
                               jsonb_build_object('message_id', v_message,
                                                  'from', v_run.session_id));
    RETURN v_message;
END;
$$;

-- The advisory lock key of a wait target (a session): suspending a wait and
-- committing a fact about its target serialize on it, across trees.
CREATE FUNCTION yuxi.wait_target_key_v1(p_session uuid) RETURNS bigint
    LANGUAGE sql IMMUTABLE AS $$
    SELECT yuxi.lock_key_v1('wait-target:' || p_session::text);
$$;

-- The sessions a wait's targets stand for (inputs: their sessions).
CREATE FUNCTION yuxi.wait_target_sessions_v1(p_kind text, p_targets uuid[]) RETURNS uuid[]
    LANGUAGE sql STABLE AS $$
    SELECT CASE p_kind
        WHEN 'sessions' THEN p_targets
        ELSE ARRAY(SELECT DISTINCT session_id FROM yuxi.inputs WHERE id = ANY(p_targets)) END;
$$;

-- Updates of `p_targets` a waiter has not consumed: turns of a target
-- reaching a terminal or waiting state, and messages from a target to the
-- waiter, after the waiter's per-target cursor (a seq of the target's tree).
CREATE FUNCTION yuxi.session_updates_v1(p_waiter uuid, p_targets uuid[], p_cursor jsonb)
RETURNS SETOF yuxi.events
    LANGUAGE sql STABLE AS $$
    SELECT e.* FROM unnest(p_targets) AS t(id)
      JOIN yuxi.sessions s ON s.id = t.id
      JOIN yuxi.events e ON e.tree_id = s.tree_id AND e.session_id = s.id
     WHERE e.seq > coalesce((p_cursor->>(s.id::text))::bigint, 0)
       AND (e.type IN ('turn.completed', 'turn.failed', 'turn.cancelled', 'turn.waiting',
                       'turn.waiting_user')
            OR (e.type = 'message.sent' AND e.data->>'to' = p_waiter::text))
     ORDER BY e.tree_id, e.seq;
$$;

-- Whether a wait's condition holds now.
CREATE FUNCTION yuxi.wait_ready_v1(p_waiter uuid, p_kind text, p_targets uuid[], p_cursor jsonb)
RETURNS boolean
    -- plpgsql, so that its plans are cached (a SQL function with subqueries
    -- is not inlined: it was parsed and planned at every suspend).
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_kind = 'sessions' THEN
        RETURN EXISTS (SELECT 1 FROM yuxi.session_updates_v1(p_waiter, p_targets, p_cursor));
    END IF;
    RETURN NOT EXISTS (SELECT 1 FROM yuxi.inputs WHERE id = ANY(p_targets)
                        AND status NOT IN ('completed', 'failed', 'cancelled'));
END;
$$;

-- Create the resume run of a resolved wait, in the waiter's tree (FIFO slot
-- claim). Idempotent: a wait is resumed at most once.
CREATE FUNCTION yuxi.resume_wait_v1(p_wait uuid) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_wait yuxi.waits;
    v_run yuxi.runs;
    v_new uuid;
BEGIN
    SELECT * INTO v_wait FROM yuxi.waits WHERE id = p_wait;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM yuxi.lock_tree_v1(v_wait.tree_id);
    SELECT * INTO v_wait FROM yuxi.waits WHERE id = p_wait FOR UPDATE;
    IF v_wait.status = 'pending' OR v_wait.resume_run_id IS NOT NULL OR NOT EXISTS (
        SELECT 1 FROM yuxi.turns WHERE id = v_wait.turn_id
           AND status IN ('waiting', 'waiting_user')) THEN
        RETURN v_wait.resume_run_id;
    END IF;
    SELECT * INTO v_run FROM yuxi.runs WHERE id = v_wait.run_id;
    INSERT INTO yuxi.runs (turn_id, session_id, tree_id, user_id, app_id, config, resume)
    VALUES (v_run.turn_id, v_run.session_id, v_run.tree_id, v_run.user_id, v_run.app_id,
            v_run.config, jsonb_build_object('reason', v_wait.reason, 'wait_id', v_wait.id,
                                             'answer', v_wait.answer))
    RETURNING id INTO v_new;
    UPDATE yuxi.waits SET resume_run_id = v_new WHERE id = p_wait;
    UPDATE yuxi.turns SET status = 'running' WHERE id = v_wait.turn_id;
    PERFORM yuxi.emit_event_v1(v_wait.tree_id, v_wait.session_id, v_wait.turn_id, v_new,
                               'turn.resumed', jsonb_build_object('reason', v_wait.reason,
                                                                  'wait_id', v_wait.id));
    PERFORM yuxi.claim_slot_v1(v_new);
    RETURN v_new;
END;
$$;

-- Resolve a pending wait (satisfied, steer, timeout) at most once. The resume
-- run is created in this transaction when the waiter is in the tree the
-- caller already holds; otherwise a job creates it (taking another tree's
-- lock here could deadlock with a waiter suspending on our target).
CREATE FUNCTION yuxi.resolve_wait_v1(p_wait uuid, p_reason text, p_held_tree uuid)
RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    v_wait yuxi.waits;
BEGIN
    UPDATE yuxi.waits
       SET status = CASE p_reason WHEN 'timeout' THEN 'timed_out' ELSE 'satisfied' END,
           reason = p_reason, resolved_at = now()
     WHERE id = p_wait AND status = 'pending'
    RETURNING * INTO v_wait;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_wait.tree_id = p_held_tree THEN
        PERFORM yuxi.resume_wait_v1(p_wait);
    ELSE
        PERFORM yuxi.defer_job_v1('maintenance', 'resume_wait',
                                  jsonb_build_object('wait_id', p_wait), NULL);
    END IF;
    RETURN true;
END;
$$;

-- Called for every event of the kinds waits look at (from emit_event_v1):
-- resolve the pending waits whose condition the event makes true.
CREATE FUNCTION yuxi.match_waits_v1(p_tree uuid, p_session uuid, p_turn uuid, p_type text,
                                    p_data jsonb) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_wait uuid;
BEGIN
    PERFORM pg_advisory_xact_lock(yuxi.wait_target_key_v1(p_session));
    FOR v_wait IN
        SELECT id FROM yuxi.waits
         WHERE status = 'pending' AND kind = 'sessions' AND targets @> ARRAY[p_session]
           AND (p_type <> 'message.sent' OR session_id = (p_data->>'to')::uuid)
         ORDER BY id FOR UPDATE
    LOOP
        PERFORM yuxi.resolve_wait_v1(v_wait, 'satisfied', p_tree);
    END LOOP;
    IF p_type IN ('turn.completed', 'turn.failed', 'turn.cancelled') THEN
        FOR v_wait IN
            SELECT w.id FROM yuxi.waits w
             WHERE w.status = 'pending' AND w.kind = 'inputs'
               AND w.targets && ARRAY(SELECT id FROM yuxi.inputs WHERE turn_id = p_turn)
               AND yuxi.wait_ready_v1(w.session_id, w.kind, w.targets, w.cursor)
             ORDER BY w.id FOR UPDATE
        LOOP
            PERFORM yuxi.resolve_wait_v1(v_wait, 'satisfied', p_tree);
        END LOOP;
    END IF;
END;
$$;

-- Suspend a run on a wait (the tool called `interrupt()`): unless the
-- condition already holds ('ready') or the wait would close a cycle of
-- sessions waiting on each other ('cycle'), store the wait, release the slot
-- (the worker job ends too), put the turn in `waiting` and schedule the
-- deadline. Returns 'suspended', 'ready' or 'cycle'; with p_next_token (as
-- complete_run_v1), the run the released slot goes to, leased to the
-- caller (`next_run`; p_mark: its checkpoint connection is marked with it).
CREATE FUNCTION yuxi.suspend_run_v1(
    p_run uuid, p_token uuid, p_kind text, p_targets uuid[], p_cursor jsonb,
    p_timeout_seconds double precision, p_next_token uuid DEFAULT NULL,
    p_lease_seconds double precision DEFAULT NULL, p_mark boolean DEFAULT false,
    OUT outcome text, OUT next_run yuxi.leased_run
)
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_wait uuid;
    v_deadline timestamptz;
BEGIN
    IF p_next_token IS NOT NULL AND p_lease_seconds IS NULL THEN
        RAISE EXCEPTION 'a next run needs a lease duration' USING ERRCODE = 'YX007';
    END IF;
    v_run := yuxi.fence_run_v1(p_run, p_token);
    -- Wait creation of one scope is serialized, so two sessions cannot each
    -- miss the other's new wait and close a cycle together.
    PERFORM pg_advisory_xact_lock(yuxi.lock_key_v1('waits:' || v_run.user_id || ':' || v_run.app_id));
    PERFORM pg_advisory_xact_lock(yuxi.wait_target_key_v1(t))
       FROM unnest(yuxi.wait_target_sessions_v1(p_kind, p_targets)) t ORDER BY t;
    IF p_kind = 'sessions' AND v_run.session_id IN (
        WITH RECURSIVE reach(session_id) AS (
            SELECT unnest(p_targets)
            UNION
            SELECT unnest(w.targets) FROM yuxi.waits w JOIN reach r ON w.session_id = r.session_id
             WHERE w.status = 'pending' AND w.kind = 'sessions')
        SELECT session_id FROM reach) THEN
        outcome := 'cycle';
        RETURN;
    END IF;
    IF yuxi.wait_ready_v1(v_run.session_id, p_kind, p_targets, p_cursor) THEN
        outcome := 'ready';
        RETURN;
    END IF;
    v_deadline := now() + make_interval(secs => greatest(p_timeout_seconds, 0));
    INSERT INTO yuxi.waits (run_id, turn_id, session_id, tree_id, user_id, app_id, kind,
                            targets, cursor, deadline)
    VALUES (p_run, v_run.turn_id, v_run.session_id, v_run.tree_id, v_run.user_id, v_run.app_id,
            p_kind, p_targets, coalesce(p_cursor, '{}'), v_deadline)
    RETURNING id INTO v_wait;
    UPDATE yuxi.runs SET status = 'suspended', finished_at = now() WHERE id = p_run;
    UPDATE yuxi.turns SET status = 'waiting' WHERE id = v_run.turn_id;
    PERFORM yuxi.defer_job_v1('maintenance', 'expire_wait',
                              jsonb_build_object('wait_id', v_wait), v_deadline);
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'run.suspended',
                               jsonb_build_object('wait_id', v_wait, 'kind', p_kind,
                                                  'targets', to_jsonb(p_targets),
                                                  'deadline', v_deadline));
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'turn.waiting', jsonb_build_object('wait_id', v_wait));
    -- The released slot goes to the tree's next pending run; with an offer,
    -- that run is leased to this worker in this transaction (as a
    -- completion's: a fan-out's last slot starts without a queue round trip).
    IF p_next_token IS NOT NULL THEN
        PERFORM yuxi.offer_hand_over_v1(p_next_token, p_lease_seconds, v_run);
    END IF;
    PERFORM yuxi.release_slot_v1(p_run);
    next_run := yuxi.handed_over_run_v1(p_next_token, p_mark);
    outcome := 'suspended';
END;
$$;

-- The deadline of a wait passed (its scheduled job, or the sweep): resume it
-- with the timeout result unless it was resolved before.
CREATE FUNCTION yuxi.expire_wait_v1(p_wait uuid) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    v_wait yuxi.waits;
BEGIN
    SELECT * INTO v_wait FROM yuxi.waits WHERE id = p_wait;
    IF NOT FOUND OR v_wait.status <> 'pending' OR v_wait.deadline > now() THEN
        RETURN false;
    END IF;
    PERFORM yuxi.lock_tree_v1(v_wait.tree_id);
    RETURN yuxi.resolve_wait_v1(p_wait, 'timeout', v_wait.tree_id);
END;
$$;

-- Sweep: expire waits past their deadline whose job was lost, and resume
-- resolved waits whose resume run was never created. Returns how many.
CREATE FUNCTION yuxi.redeliver_waits_v1(p_grace interval) RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    v_wait uuid;
    v_count integer := 0;
BEGIN
    FOR v_wait IN SELECT id FROM yuxi.waits
                   WHERE status = 'pending' AND deadline < now() - p_grace LOOP
        IF yuxi.expire_wait_v1(v_wait) THEN
            v_count := v_count + 1;
        END IF;
    END LOOP;
    FOR v_wait IN SELECT w.id FROM yuxi.waits w JOIN yuxi.turns t ON t.id = w.turn_id
                   WHERE w.status <> 'pending' AND w.status <> 'cancelled'
                     AND w.resume_run_id IS NULL AND t.status IN ('waiting', 'waiting_user')
                     AND w.resolved_at < now() - p_grace LOOP
        IF yuxi.resume_wait_v1(v_wait) IS NOT NULL THEN
            v_count := v_count + 1;
        END IF;
    END LOOP;
    RETURN v_count;
END;
$$;

-- Record that messages reached the receiver's conversation (the run that
-- took them in), fenced by that run's lease.
CREATE FUNCTION yuxi.mark_messages_processed_v1(p_run uuid, p_token uuid, p_messages uuid[])
RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_count integer;
BEGIN
    PERFORM yuxi.check_lease_v1(p_run, p_token);
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run;
    UPDATE yuxi.messages SET processed_at = now(), processed_run_id = p_run
     WHERE id = ANY(p_messages) AND receiver_session_id = v_run.session_id
       AND processed_at IS NULL;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;

