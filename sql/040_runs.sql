-- Runs: leases, fenced writes and the ends of a run. Every function a worker
-- calls takes its lease token; a worker whose lease was lost (expired, or the
-- run was recovered by someone else) gets YX003 and changes nothing.

-- What a worker needs to execute a run it leased: the run, its turn's first
-- input, the session's identity, and whether anything waits at the run's
-- first model boundary (a cancel intent, a steer of its turn, an unprocessed
-- message to its session): when nothing does, the worker skips that check.
-- `first_run`: the first run of the session's first turn (attempt 1, no
-- resume), so its conversation has no checkpoint yet (only runs of a session
-- and the cleanup of a turn that had runs write its checkpoints): the
-- worker's checkpointer skips the read of the latest checkpoint.
CREATE TYPE yuxi.leased_run AS (
    id uuid, turn_id uuid, session_id uuid, tree_id uuid, user_id uuid, app_id uuid,
    attempt integer, config jsonb, resume jsonb,
    input_id uuid, input_content text,
    session_name text, session_path text, session_parent_id uuid,
    boundary_pending boolean,
    created_at timestamptz, started_at timestamptz,
    first_run boolean
);

CREATE FUNCTION yuxi.leased_run_v1(p_run uuid) RETURNS yuxi.leased_run
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_out yuxi.leased_run;
BEGIN
    SELECT r.id, r.turn_id, r.session_id, r.tree_id, r.user_id, r.app_id, r.attempt,
           r.config, r.resume, t.input_id, i.content, s.name, s.path, s.parent_id,
           t.cancel_requested_at IS NOT NULL
           OR EXISTS (SELECT 1 FROM yuxi.inputs x WHERE x.turn_id = t.id AND x.id <> t.input_id)
           OR EXISTS (SELECT 1 FROM yuxi.messages m
                      WHERE m.receiver_session_id = r.session_id AND m.processed_at IS NULL),
           r.created_at, r.started_at,
           r.attempt = 1 AND r.resume IS NULL
           AND NOT EXISTS (SELECT 1 FROM yuxi.turns p
                            WHERE p.session_id = r.session_id AND p.seq < t.seq)
      INTO v_out
      FROM yuxi.runs r
      JOIN yuxi.turns t ON t.id = r.turn_id
      JOIN yuxi.inputs i ON i.id = t.input_id
      JOIN yuxi.sessions s ON s.id = r.session_id
     WHERE r.id = p_run;
    RETURN v_out;
END;
$$;

-- A run whose lease was just taken with p_token, as its worker reads it;
-- p_mark: the caller's connection is the one its checkpointer writes on,
-- marked with the lease in this transaction (sql/110_checkpoint_fence.sql).
CREATE FUNCTION yuxi.taken_run_v1(p_run uuid, p_token uuid, p_mark boolean)
RETURNS yuxi.leased_run
    LANGUAGE plpgsql AS $$
BEGIN
    IF p_mark THEN
        PERFORM yuxi.mark_checkpoint_connection_v1(p_run::text, p_token::text);
    END IF;
    RETURN yuxi.leased_run_v1(p_run);
END;
$$;

-- A run in status p_from becomes `running`, leased with p_token until
-- p_expires to the worker (host, claimer) that will execute it, and
-- `run.started` says so (`p_how`, when given, is a flag in its data: how the
-- run got to the worker without a job of its own). The one place a lease is
-- taken on an existing run: a job's or claim's start (start_run_v1), a
-- hand-over (give_slot_v1), a queued run taken at a completion
-- (take_queued_run_v1). The caller holds the tree lock. Returns the run,
-- NULL (and changes nothing) when it is not in p_from.
CREATE FUNCTION yuxi.lease_run_v1(p_run uuid, p_from text, p_token uuid, p_host text,
                                  p_claimer integer, p_expires timestamptz,
                                  p_how text DEFAULT NULL) RETURNS yuxi.runs
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
BEGIN
    UPDATE yuxi.runs
       SET status = 'running', lease_token = p_token, started_at = now(), host_id = p_host,
           claimer = p_claimer, lease_expires_at = p_expires
     WHERE id = p_run AND status = p_from
    RETURNING * INTO v_run;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM yuxi.emit_run_started_v1(v_run, p_how);
    RETURN v_run;
END;
$$;

-- `run.started` of a run just leased: its attempt, its worker's host, and
-- `p_how` as a flag when given. Written here only: by lease_run_v1, and by
-- start_turn_run_v1 (sql/030_sessions.sql) for a turn's first run created
-- leased.
CREATE FUNCTION yuxi.emit_run_started_v1(p_run yuxi.runs, p_how text DEFAULT NULL)
RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM yuxi.emit_event_v1(p_run.tree_id, p_run.session_id, p_run.turn_id, p_run.id,
                               'run.started', jsonb_strip_nulls(jsonb_build_object(
                                   'attempt', p_run.attempt, 'host', p_run.host_id))
                               || CASE WHEN p_how IS NULL THEN '{}'::jsonb
                                       ELSE jsonb_build_object(p_how, true) END);
END;
$$;

-- Take the lease of a ready run: it becomes running with a fresh token.
-- Returns NULL when the run is not ready (a duplicate or stale job), so the
-- caller simply stops. p_mark: the caller's connection is the one its
-- checkpointer writes on; it is marked with the lease in this transaction
-- (sql/110_checkpoint_fence.sql), which saves the worker a round trip.
CREATE FUNCTION yuxi.start_run_v1(p_run uuid, p_token uuid, p_lease_seconds double precision,
                                  p_mark boolean DEFAULT false, p_host text DEFAULT NULL,
                                  p_claimer integer DEFAULT NULL)
RETURNS yuxi.leased_run
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
BEGIN
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run;
    IF NOT FOUND OR v_run.status <> 'ready' THEN
        RETURN NULL;
    END IF;
    PERFORM yuxi.lock_tree_v1(v_run.tree_id);
    IF (yuxi.lease_run_v1(p_run, 'ready', p_token, p_host, p_claimer,
                          clock_timestamp() + make_interval(secs => p_lease_seconds))).id IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN yuxi.taken_run_v1(p_run, p_token, p_mark);
END;
$$;

-- A worker woken by `yuxi_ready` (defer_run_job_v1) takes a ready run
-- without its job: the lease (start_run_v1) and the removal of the job still
-- waiting in the queue commit together, so Procrastinate never hands that job
-- out. A job already fetched stays: its task finds the run taken (start_run_v1
-- returns NULL: the job is a no-op). NULL when the run is not ready.
CREATE FUNCTION yuxi.claim_run_v1(p_run uuid, p_job bigint, p_token uuid,
                                  p_lease_seconds double precision, p_mark boolean,
                                  p_host text, p_claimer integer)
RETURNS yuxi.leased_run
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.leased_run;
BEGIN
    v_run := yuxi.start_run_v1(p_run, p_token, p_lease_seconds, p_mark, p_host, p_claimer);
    IF v_run.id IS NOT NULL THEN
        PERFORM yuxi.drop_run_job_v1(p_job, p_run);
    END IF;
    RETURN v_run;
END;
$$;

-- The job of a claimed run, if no worker fetched it yet. A worker fetching
-- it at this instant (Procrastinate's fetch locks the row it takes, woken by
-- the same commit) is not waited for: its task will find the run taken, and
-- the claim commits without a wait on its critical path. (Procrastinate's
-- own triggers on its jobs table name its tables unqualified.)
CREATE FUNCTION yuxi.drop_run_job_v1(p_job bigint, p_run uuid) RETURNS void
    LANGUAGE plpgsql
    SET search_path = procrastinate, pg_catalog
AS $$
BEGIN
    DELETE FROM procrastinate_jobs
     WHERE id = (SELECT id FROM procrastinate_jobs
                  WHERE id = p_job AND status = 'todo' AND task_name = 'execute_run'
                    AND args->>'run_id' = p_run::text
                    FOR UPDATE SKIP LOCKED);
END;
$$;

-- Extend a lease. Returns false when the lease is lost: the worker must stop.
CREATE FUNCTION yuxi.heartbeat_run_v1(p_run uuid, p_token uuid, p_lease_seconds double precision)
RETURNS boolean
    LANGUAGE sql AS $$
    WITH extended AS (
        UPDATE yuxi.runs
           SET lease_expires_at = clock_timestamp() + make_interval(secs => p_lease_seconds)
         WHERE id = p_run AND lease_token = p_token AND status = 'running'
           AND lease_expires_at > clock_timestamp()
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM extended);
$$;

-- Assert the caller still holds the lease, and keep it held (FOR SHARE) until
-- the caller's transaction ends: checkpoint writes run this first, so a
-- recovery cannot slip in between the check and the write.
CREATE FUNCTION yuxi.check_lease_v1(p_run uuid, p_token uuid) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM yuxi.runs
     WHERE id = p_run AND lease_token = p_token AND status = 'running'
       AND lease_expires_at > clock_timestamp()
     FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease of run % is lost', p_run USING ERRCODE = 'YX003';
    END IF;
END;
$$;

-- Lock the tree, then the run, and return the run if the token holds its
-- lease; raise YX003 otherwise. The start of every fenced transition. The run
-- row is share-locked: tool transactions of the same run hold it shared too
-- (check_lease_v1) while they wait for the tree, so an exclusive lock here
-- would deadlock with them; the transitions that end the run upgrade it.
CREATE FUNCTION yuxi.fence_run_v1(p_run uuid, p_token uuid) RETURNS yuxi.runs
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
BEGIN
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'run % not found', p_run USING ERRCODE = 'YX002';
    END IF;
    PERFORM yuxi.lock_tree_v1(v_run.tree_id);
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run FOR SHARE;
    IF v_run.status <> 'running' OR v_run.lease_token IS DISTINCT FROM p_token
       OR v_run.lease_expires_at <= clock_timestamp() THEN
        RAISE EXCEPTION 'lease of run % is lost', p_run USING ERRCODE = 'YX003';
    END IF;
    RETURN v_run;
END;
$$;

-- An event reported by the executing worker (model output, tool start/end),
-- fenced by its lease. Returns the event's seq, or NULL for a duplicate.
CREATE FUNCTION yuxi.emit_run_event_v1(
    p_run uuid, p_token uuid, p_type text, p_data jsonb, p_dedupe_key text
) RETURNS bigint
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
BEGIN
    v_run := yuxi.fence_run_v1(p_run, p_token);
    RETURN yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                              p_type, p_data, p_dedupe_key);
END;
$$;

-- Events of one type reported together by the executing worker (the
-- `tool.started` or `tool.finished` of a step's parallel tool calls:
-- yuxi.runtime.group_commit), fenced by its lease, in one statement
-- (emit_events_v1: in order, consecutive numbers, duplicates skipped).
-- `p_events`: a JSON array of {data, dedupe_key} (one jsonb parameter, not
-- arrays: a text array of JSON costs the worker a regex escape per element).
CREATE FUNCTION yuxi.emit_run_events_v1(p_run uuid, p_token uuid, p_type text, p_events jsonb)
RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
BEGIN
    v_run := yuxi.fence_run_v1(p_run, p_token);
    PERFORM yuxi.emit_events_v1(v_run.tree_id, (
        SELECT jsonb_agg(jsonb_build_object(
                   'session_id', v_run.session_id, 'turn_id', v_run.turn_id, 'run_id', p_run,
                   'type', p_type, 'data', e.value->'data',
                   'dedupe_key', e.value->'dedupe_key') ORDER BY e.o)
          FROM jsonb_array_elements(p_events) WITH ORDINALITY e(value, o)));
END;
$$;

-- End a turn whose last run is p_run (already ended by the caller): the turn
-- and its input take the final status, the run becomes the turn's result, the
-- slot goes to the tree FIFO (then to a run its turn's end wakes) and the
-- session's next queued turn starts. Any of these runs may be handed over to
-- the caller when it opened an offer (offer_hand_over_v1).
CREATE FUNCTION yuxi.finish_turn_v1(p_run uuid, p_status text, p_error text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_turn yuxi.turns;
BEGIN
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run;
    UPDATE yuxi.turns
       SET status = p_status, result_run_id = p_run, error = p_error, finished_at = now()
     WHERE id = v_run.turn_id
       AND status IN ('running', 'waiting', 'waiting_user', 'cancelling')
    RETURNING * INTO v_turn;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'turn % is not in flight', v_run.turn_id USING ERRCODE = 'YX001';
    END IF;
    -- The turn's own input and the steers it took in end with it.
    UPDATE yuxi.inputs
       SET status = p_status, error = p_error, finished_at = now(),
           started_at = coalesce(started_at, now())
     WHERE turn_id = v_turn.id AND status IN ('queued', 'started');
    PERFORM yuxi.release_slot_v1(p_run);
    PERFORM yuxi.emit_event_v1(v_turn.tree_id, v_turn.session_id, v_turn.id, p_run,
                               'turn.' || p_status,
                               jsonb_build_object('input_id', v_turn.input_id, 'error', p_error));
    PERFORM yuxi.start_next_turn_v1(v_turn.session_id);
END;
$$;

-- Tool calls begin (the tool tasks of a model step, batched by the worker:
-- yuxi.runtime.group_commit): unless a cancel intent was committed for the
-- run's turn (then nothing is recorded and false comes back: the run stops
-- before the calls), their `tool.started` events are recorded, fenced by the
-- lease. The cancel check and the events in one statement: a fan-out's calls
-- take the tree's lock once or twice in all, not once each (issue 15).
CREATE FUNCTION yuxi.start_tool_calls_v1(p_run uuid, p_token uuid, p_events jsonb)
RETURNS boolean
    LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM yuxi.runs r JOIN yuxi.turns t ON t.id = r.turn_id
               WHERE r.id = p_run AND t.cancel_requested_at IS NOT NULL) THEN
        RETURN false;
    END IF;
    PERFORM yuxi.emit_run_events_v1(p_run, p_token, 'tool.started', p_events);
    RETURN true;
END;
$$;

-- Record that steers of the run's turn reached the conversation (they are in
-- the checkpoint the worker just committed).
CREATE FUNCTION yuxi.mark_steers_delivered_v1(p_run uuid, p_token uuid, p_inputs uuid[])
RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_marked uuid[];
BEGIN
    v_run := yuxi.fence_run_v1(p_run, p_token);
    WITH marked AS (
        UPDATE yuxi.inputs SET status = 'started', started_at = now()
         WHERE id = ANY(p_inputs) AND turn_id = v_run.turn_id AND status = 'queued'
        RETURNING id)
    SELECT array_agg(id) INTO v_marked FROM marked;
    IF v_marked IS NOT NULL THEN
        PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                                   'input.delivered', jsonb_build_object('input_ids', v_marked));
    END IF;
    RETURN coalesce(array_length(v_marked, 1), 0);
END;
$$;

-- A completing or suspending transaction whose offer no run took
-- (offer_hand_over_v1: the worker frees its place) takes the oldest queued
-- run of the worker's queues instead, as Procrastinate's fetch would hand it
-- out next: a ready run whose `execute_run` job is due (one not yet due was
-- announced to a claimer that may still claim it, sql/020_slots.sql), in
-- `runs` or the worker host's `runs@<host>`. It is leased to the worker
-- with the offered token (run.started, `from_queue: true`) and its job is
-- deleted: the fetch, the lease's own transaction and the job's end become
-- this commit. Nothing here waits: the job row and the run's tree (another
-- tree's lock, outside the lock order, as this transaction holds its own)
-- are taken with SKIP LOCKED, so a fetch, a claim or a transition of that
-- tree in flight keeps the run and this returns NULL. A job whose run is
-- not ready any more (stale) is left to its fetch, a no-op. Returns the
-- run, or NULL.
CREATE FUNCTION yuxi.take_queued_run_v1(p_token uuid) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_host text := yuxi.hand_over_host_v1();
    v_job bigint;
    v_run uuid;
    v_tree uuid;
BEGIN
    IF p_token IS NULL THEN  -- no offer
        RETURN NULL;
    END IF;
    -- The oldest due job of each queue, one index lookup per queue
    -- (procrastinate_jobs_yuxi_runs_todo, in id order: each stops at its
    -- first due job, whatever the backlog or the other tasks' scheduled
    -- jobs; one lookup over both queues would sort them all).
    SELECT j.id, (j.args->>'run_id')::uuid INTO v_job, v_run
      FROM procrastinate.procrastinate_jobs j
     WHERE j.id = (SELECT min(oldest.id)
                     FROM unnest(ARRAY['runs', 'runs@' || v_host]) queue(name),
                          LATERAL (SELECT q.id FROM procrastinate.procrastinate_jobs q
                                    WHERE q.status = 'todo' AND q.task_name = 'execute_run'
                                      AND q.queue_name = queue.name
                                      AND (q.scheduled_at IS NULL OR q.scheduled_at <= now())
                                    ORDER BY q.id LIMIT 1) oldest)
       AND j.status = 'todo'
       FOR UPDATE SKIP LOCKED;
    IF v_job IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT tree_id INTO v_tree FROM yuxi.runs WHERE id = v_run AND status = 'ready';
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM yuxi.trees WHERE id = v_tree FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Ready again under the lock (a claim may have committed meanwhile).
    IF (yuxi.lease_run_v1(v_run, 'ready', p_token, v_host, yuxi.hand_over_claimer_v1(),
                          yuxi.hand_over_lease_expiry_v1(), 'from_queue')).id IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM yuxi.drop_run_job_v1(v_job, v_run);
    RETURN v_run;
END;
$$;

-- Close the offer of a completing or suspending transaction
-- (offer_hand_over_v1): the run that took it, else the queued run taken in
-- its place (take_queued_run_v1; a stopping worker makes no offer, so it
-- takes none: those runs have jobs other workers fetch), leased, with the
-- caller's checkpoint connection marked with it when p_mark; NULL when
-- there is none.
CREATE FUNCTION yuxi.handed_over_run_v1(p_next_token uuid, p_mark boolean)
RETURNS yuxi.leased_run
    LANGUAGE plpgsql AS $$
DECLARE
    v_next uuid := yuxi.close_hand_over_v1();
BEGIN
    IF v_next IS NULL THEN
        v_next := yuxi.take_queued_run_v1(p_next_token);
    END IF;
    IF v_next IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN yuxi.taken_run_v1(v_next, p_next_token, p_mark);
END;
$$;

-- The executing worker completes its run with the turn's output. `p_delivered`
-- are the steers its conversation contains; if the turn took in a steer that
-- is not among them (it arrived while the model produced what would have been
-- the final answer), nothing changes and 'steer' is returned: the worker must
-- deliver it with one more model call. Receiving a steer takes the tree lock
-- too, so a steer either lands before this check or finds the session idle.
-- A committed cancel intent wins over the result: the run is cancelled.
-- p_events ([{type, data, dedupe_key}]) are the run's facts reported with
-- the completion (the final answer's `message`), recorded first whatever the
-- outcome: they happened.
-- With p_next_token, the caller offers to go on with a run this completion
-- gives a slot to (offer_hand_over_v1, sql/020_slots.sql): the oldest pending
-- run of the tree served by the released slot, else the run of a wait this
-- turn's end satisfies, else the session's next queued turn; when one may run
-- on the caller's host it is leased to the caller with that token (next_run)
-- instead of being given a job: one commit and no queue round trip between a
-- slot's runs (else the oldest queued run: take_queued_run_v1); p_mark
-- marks the caller's connection with its lease (as in start_run_v1), or,
-- with no run to go on with, unmarks it: the worker hands it back without a
-- round trip of its own. Without p_next_token (a stopping worker, or a
-- chain at its bound) nothing is handed over: each run that gets a slot
-- gets a job.
-- p_archive_*: the turn's messages (its checkpoint's, serialized), archived
-- into yuxi.conversation in this transaction when the turn completes
-- (sql/140_conversation.sql; the next turn's first run then only drops them
-- from the checkpoint). Turns that end otherwise leave that to the next
-- turn's first run.
CREATE FUNCTION yuxi.complete_run_v1(
    p_run uuid, p_token uuid, p_output jsonb, p_delivered uuid[] DEFAULT '{}',
    p_next_token uuid DEFAULT NULL, p_lease_seconds double precision DEFAULT NULL,
    p_events jsonb DEFAULT '[]', p_mark boolean DEFAULT false,
    p_archive_ids text[] DEFAULT NULL, p_archive_turns uuid[] DEFAULT NULL,
    p_archive_serde text[] DEFAULT NULL, p_archive_messages bytea[] DEFAULT NULL,
    OUT outcome text, OUT next_run yuxi.leased_run
)
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_event jsonb;
BEGIN
    IF p_next_token IS NOT NULL AND p_lease_seconds IS NULL THEN
        RAISE EXCEPTION 'a next run needs a lease duration' USING ERRCODE = 'YX007';
    END IF;
    v_run := yuxi.fence_run_v1(p_run, p_token);
    FOR v_event IN SELECT * FROM jsonb_array_elements(coalesce(p_events, '[]')) LOOP
        PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                                   v_event->>'type', v_event->'data', v_event->>'dedupe_key');
    END LOOP;
    -- A cancel intent committed before this boundary wins over the result.
    IF EXISTS (SELECT 1 FROM yuxi.turns
               WHERE id = v_run.turn_id AND cancel_requested_at IS NOT NULL) THEN
        PERFORM yuxi.cancel_run_v1(p_run, p_token);
        outcome := 'cancelled';
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM yuxi.inputs i JOIN yuxi.turns t ON t.id = i.turn_id
               WHERE i.turn_id = v_run.turn_id AND i.id <> t.input_id
                 AND NOT (i.id = ANY(coalesce(p_delivered, '{}')))) THEN
        outcome := 'steer';
        RETURN;
    END IF;
    -- The completed turn's conversation joins the archive with its
    -- completion: one commit, and a turn's messages are never archived
    -- before its end is (a 'steer' or 'cancelled' outcome archives nothing).
    PERFORM yuxi.append_conversation_v1(v_run.session_id, p_archive_ids, p_archive_turns,
                                        p_archive_serde, p_archive_messages);
    -- The turn's final checkpoint supersedes every earlier one (still under
    -- the lease, which the checkpoint tables' fence checks).
    PERFORM yuxi.prune_checkpoints_v1(v_run.session_id::text);
    UPDATE yuxi.runs SET status = 'completed', output = p_output, finished_at = now()
     WHERE id = p_run;
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'run.completed', '{}');
    IF p_next_token IS NOT NULL THEN
        PERFORM yuxi.offer_hand_over_v1(p_next_token, p_lease_seconds, v_run);
    END IF;
    PERFORM yuxi.finish_turn_v1(p_run, 'completed', NULL);
    next_run := yuxi.handed_over_run_v1(p_next_token, p_mark);
    IF (next_run).id IS NULL AND p_mark THEN
        PERFORM yuxi.mark_checkpoint_connection_v1('', '');
    END IF;
    outcome := 'completed';
END;
$$;

-- The executing worker fails its run with an explicit error; the turn fails.
CREATE FUNCTION yuxi.fail_run_v1(p_run uuid, p_token uuid, p_error text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
BEGIN
    v_run := yuxi.fence_run_v1(p_run, p_token);
    UPDATE yuxi.runs SET status = 'failed', error = p_error, finished_at = now()
     WHERE id = p_run;
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'run.failed', jsonb_build_object('error', p_error));
    PERFORM yuxi.finish_turn_v1(p_run, 'failed', p_error);
END;
$$;

-- A worker whose run met a connection-level error (the database restarted,
-- failed over, went away, terminated its backend) reports it once it reaches
-- the database again: fenced by the lease token, the run keeps its status
-- and its lease expires now, so the next recovery sweep continues the turn
-- as an infrastructure retry (recover_run_v1). False when the lease is not
-- held any more (the run ended or was recovered meanwhile).
CREATE FUNCTION yuxi.report_run_infra_fault_v1(p_run uuid, p_token uuid, p_error text)
    RETURNS boolean
    LANGUAGE plpgsql AS $$
BEGIN
    UPDATE yuxi.runs
       SET infra_error = left(p_error, 2000),
           lease_expires_at = least(lease_expires_at, clock_timestamp())
     WHERE id = p_run AND lease_token = p_token AND status = 'running';
    RETURN FOUND;
END;
$$;

-- Recover a run whose lease expired (its worker died or hung, or its
-- connection to the database was cut): the run fails with the reason; the
-- turn continues in a new run that inherits the slot and resumes from the
-- last checkpoint. A run cut off by the database (its worker reported a
-- connection fault, or the server restarted while it ran) is an
-- infrastructure retry, bounded by p_max_infra_retries; any other lost
-- lease uses up one of p_max_attempts. Past its bound the turn fails
-- explicitly. Returns the new run's id, or NULL when the run was not
-- recoverable (lease still valid, already ended) or the turn gave up.
CREATE FUNCTION yuxi.recover_run_v1(p_run uuid, p_max_attempts integer,
                                    p_max_infra_retries integer DEFAULT 20) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_new uuid;
    v_error text;
    v_infra boolean;
BEGIN
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM yuxi.lock_tree_v1(v_run.tree_id);
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run FOR UPDATE;
    IF v_run.status <> 'running' OR v_run.lease_expires_at > clock_timestamp() THEN
        RETURN NULL;
    END IF;
    v_infra := v_run.infra_error IS NOT NULL
               OR pg_postmaster_start_time() > v_run.started_at;
    IF v_infra THEN
        v_error := format('database connection lost (infrastructure retry %s of %s): %s',
                          v_run.infra_retries + 1, p_max_infra_retries,
                          coalesce(v_run.infra_error, 'the database server restarted'));
    ELSE
        v_error := format('lease expired at %s (attempt %s): the worker stopped heartbeating',
                          v_run.lease_expires_at, v_run.attempt - v_run.infra_retries);
    END IF;
    UPDATE yuxi.runs SET status = 'failed', error = v_error, finished_at = now()
     WHERE id = p_run;
    IF EXISTS (SELECT 1 FROM yuxi.turns
               WHERE id = v_run.turn_id AND cancel_requested_at IS NOT NULL) THEN
        -- Cancelled while its worker was gone: clean up, never retry.
        PERFORM yuxi.release_slot_v1(p_run);
        PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                                   'run.failed', jsonb_build_object('error', v_error));
        PERFORM yuxi.enter_cancelling_v1(v_run.turn_id);
        RETURN NULL;
    END IF;
    IF (v_infra AND v_run.infra_retries < p_max_infra_retries)
       OR (NOT v_infra AND v_run.attempt - v_run.infra_retries < p_max_attempts) THEN
        INSERT INTO yuxi.runs (turn_id, session_id, tree_id, user_id, app_id, attempt,
                               infra_retries, status, config)
        VALUES (v_run.turn_id, v_run.session_id, v_run.tree_id, v_run.user_id, v_run.app_id,
                v_run.attempt + 1, v_run.infra_retries + v_infra::int, 'ready', v_run.config)
        RETURNING id INTO v_new;
        -- The new run inherits the slot: the turn never re-queues behind others.
        UPDATE yuxi.slot_claims SET run_id = v_new, claimed_at = now() WHERE run_id = p_run;
        PERFORM yuxi.defer_run_job_v1(v_new);
        PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                                   'run.failed',
                                   jsonb_build_object('error', v_error, 'retry_run_id', v_new,
                                                      'infrastructure', v_infra));
        RETURN v_new;
    END IF;
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'run.failed', jsonb_build_object('error', v_error));
    IF v_infra THEN
        PERFORM yuxi.finish_turn_v1(
            p_run, 'failed', format('gave up after %s infrastructure retries: %s',
                                    v_run.infra_retries, v_error));
    ELSE
        PERFORM yuxi.finish_turn_v1(
            p_run, 'failed', format('gave up after %s attempts: %s',
                                    v_run.attempt - v_run.infra_retries, v_error));
    END IF;
    RETURN NULL;
END;
$$;

-- Re-deliver jobs of ready runs that have none waiting or running (a job
-- lost between commit and pickup, or whose worker died before taking the
-- lease). Returns the runs re-deferred.
CREATE FUNCTION yuxi.redeliver_ready_runs_v1(p_older_than interval) RETURNS SETOF uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_run uuid;
BEGIN
    FOR v_run IN
        SELECT r.id FROM yuxi.runs r
         WHERE r.status = 'ready' AND r.created_at < now() - p_older_than
           AND NOT EXISTS (
               SELECT 1 FROM procrastinate.procrastinate_jobs j
                WHERE j.task_name = 'execute_run' AND j.status IN ('todo', 'doing')
                  AND j.args->>'run_id' = r.id::text
                  AND (j.status = 'todo' OR j.worker_id IS NOT NULL))
         FOR UPDATE SKIP LOCKED
    LOOP
        PERFORM yuxi.defer_run_job_v1(v_run);
        RETURN NEXT v_run;
    END LOOP;
END;
$$;
