-- Tree slots: at most trees.slot_capacity runs of one tree hold a slot at any
-- instant. Claims and releases lock the tree row, so counting and inserting
-- happen under one lock and the FIFO of pending runs is served in order.

-- Defer the Procrastinate job that executes a run, in the caller's
-- transaction, so the ready run and its job commit together or not at all.
-- Its queue: the host queue `runs@<host>` of the host holding the tree's live
-- sandbox (sandbox affinity, sql/120_hosts.sql), else the shared `runs`.
-- (plpgsql, like every function on the hot path: it keeps its plans for the
-- connection's life, where a LANGUAGE sql function that cannot be inlined is
-- parsed and planned again at every call.)
CREATE FUNCTION yuxi.defer_run_job_v1(p_run uuid) RETURNS bigint
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_queue text;
    v_claimer integer;
    v_job bigint;
BEGIN
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run;
    v_queue := yuxi.run_queue_v1(v_run.tree_id);
    -- A worker of the queue with a free slot claims the run at once, one
    -- round trip instead of Procrastinate's fetch and then the lease
    -- (claim_run_v1); the job stays the way the run is executed when no
    -- worker claims it (all busy, the notification missed). The run is
    -- announced to one claimer, the least loaded (pick_claimer_v1), and
    -- counts toward its load from now on. While a claimer of the queue
    -- listens, the job is due 20 ms later:
    -- Procrastinate's workers, woken by the same commit, would otherwise
    -- race the claim for it (a fetch and a task that finds its run taken,
    -- or a claim waiting on the fetch), at every run's start.
    v_claimer := yuxi.pick_claimer_v1(v_queue, p_run);
    IF v_claimer IS DISTINCT FROM v_run.claimer THEN
        UPDATE yuxi.runs SET claimer = v_claimer WHERE id = p_run;
    END IF;
    v_job := yuxi.defer_job_v1(v_queue, 'execute_run', jsonb_build_object('run_id', p_run),
                               CASE WHEN v_claimer IS NOT NULL
                                    THEN clock_timestamp() + interval '20 milliseconds' END);
    -- The session lets its claimer read only what it does not hold of the
    -- session's archive, with the lease (yuxi.runtime.executor).
    PERFORM pg_notify('yuxi_ready', v_queue || ' ' || p_run || ' ' || v_job || ' '
                                    || v_run.session_id || ' ' || coalesce(v_claimer, 0));
    RETURN v_job;
END;
$$;

-- Procrastinate's trigger wakes every worker's fetch when a job is inserted,
-- also when the job is due later (a ready run's job waiting for its claimer,
-- above): those fetches found nothing, two wasted round trips per worker
-- and about 2 ms of workers' CPU per turn. A job inserted due later wakes
-- nobody: the workers' polling finds it once it is due
-- (fetch_job_polling_interval, workers/app.py). Procrastinate's own
-- definition, with the due condition added to its WHEN.
DROP TRIGGER procrastinate_jobs_notify_queue_job_inserted_v1 ON procrastinate.procrastinate_jobs;
CREATE TRIGGER procrastinate_jobs_notify_queue_job_inserted_v1
    AFTER INSERT ON procrastinate.procrastinate_jobs
    FOR EACH ROW WHEN (new.status = 'todo'::procrastinate.procrastinate_job_status
                       AND (new.scheduled_at IS NULL OR new.scheduled_at <= now()))
    EXECUTE PROCEDURE procrastinate.procrastinate_notify_queue_job_inserted_v1();

-- A completion that hands nothing over takes the oldest due `execute_run`
-- job of its worker's queues (take_queued_run_v1, sql/040_runs.sql): this
-- index finds it in a few pages, past any backlog of other tasks' jobs
-- (the scheduled deadlines of waits) that Procrastinate's own indexes
-- would make it scan.
CREATE INDEX procrastinate_jobs_yuxi_runs_todo ON procrastinate.procrastinate_jobs (queue_name, id)
    WHERE status = 'todo' AND task_name = 'execute_run';

-- The claiming workers listening now, from the server's own list of
-- sessions (a worker that dies drops out with its connection): a claimer's
-- LISTEN connection is named `yuxi-claims <host>` (yuxi.runtime.live). It
-- claims runs of `runs` (every host's) and of `runs@<host>` (its host's).
CREATE FUNCTION yuxi.claimers_v1() RETURNS TABLE (pid integer, host text)
    LANGUAGE sql STABLE AS $$
    SELECT a.pid, substr(a.application_name, length('yuxi-claims ') + 1)
      FROM pg_stat_activity a
     WHERE a.datname = current_database() AND a.application_name LIKE 'yuxi-claims %'
     ORDER BY a.pid;
$$;

-- The claimer a ready run of `p_queue` is announced to (NULL: none
-- listens): of the claimers serving the queue, the one with the fewest runs
-- announced to it or running on it (runs.claimer; counted up to 64, beyond
-- which a worker is busy anyway), ties broken by the run's id, so that each
-- run has its own order of equally loaded claimers. The least loaded, not a
-- hash alone: a fan-out's first runs, announced in one transaction, spread
-- over the workers (each counts the ones before it), and so do the chains
-- of runs its slots hand over within a worker. (plpgsql: its plan is
-- cached; as a SQL function with a subquery it cannot be inlined, and it
-- was parsed and planned again at every call.)
CREATE FUNCTION yuxi.pick_claimer_v1(p_queue text, p_run uuid) RETURNS integer
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT c.pid FROM yuxi.claimers_v1() c
             WHERE p_queue = 'runs' OR p_queue = 'runs@' || c.host
             ORDER BY yuxi.claimer_load_v1(c.pid), hashtext(p_run::text || c.pid)
             LIMIT 1);
END;
$$;

-- A claimer's load: the runs announced to it or running on it
-- (runs.claimer), counted up to 64.
CREATE FUNCTION yuxi.claimer_load_v1(p_claimer integer) RETURNS bigint
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT count(*) FROM (SELECT FROM yuxi.runs
                                   WHERE claimer = p_claimer
                                     AND status IN ('ready', 'running')
                                   LIMIT 64) l);
END;
$$;

-- Defer a Procrastinate job (its id), under Procrastinate's search_path
-- (its functions and triggers name its tables unqualified). Functions of
-- ours on the hot path call this one rather than run under that search_path
-- themselves: a cached plan made under another search_path is made again,
-- so a function called under both (an event, a slot) was planned again at
-- every call, each wait's suspend and resume paying for it.
CREATE FUNCTION yuxi.defer_job_v1(p_queue text, p_task text, p_args jsonb,
                                  p_at timestamptz) RETURNS bigint
    LANGUAGE plpgsql
    SET search_path = procrastinate, pg_catalog
AS $$
BEGIN
    RETURN (procrastinate_defer_jobs_v1(ARRAY[ROW(
        p_queue, p_task, 0, NULL, NULL, p_args, p_at)::procrastinate_job_to_defer_v1]))[1];
END;
$$;

-- How many runs being created in the tree can have a slot at once: its free
-- slots, none while a run waits in its FIFO (a new run never jumps the
-- queue). The caller holds the tree lock.
CREATE FUNCTION yuxi.free_slots_v1(p_tree yuxi.trees) RETURNS integer
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM yuxi.runs WHERE tree_id = p_tree.id AND status = 'pending') THEN
        RETURN 0;
    END IF;
    RETURN greatest(p_tree.slot_capacity
                    - (SELECT count(*) FROM yuxi.slot_claims WHERE tree_id = p_tree.id), 0);
END;
$$;

-- Hand-over (issue 15). A worker completing (or suspending) a run offers, in
-- that transaction, to go on at once with a run that this transaction gives a
-- slot to: a pending run of the tree served by the slot it releases, the
-- parent whose wait its completion satisfies, its session's next turn. The
-- offer lasts until the transaction ends (transaction-local settings, so a
-- pooled connection never carries it further) and is taken at most once:
-- the first run given a slot that may run on the worker's host becomes
-- `running`, leased to the worker with the offered token (run.started, no
-- job); every other run gets its job as before. That saves the job's NOTIFY,
-- a worker's fetch and the start transaction between a slot's release and
-- its next run. A run so leased is like any leased run: if the worker dies
-- before or while executing it, its lease expires and recovery continues it.
CREATE FUNCTION yuxi.offer_hand_over_v1(p_token uuid, p_lease_seconds double precision,
                                        p_offering yuxi.runs) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF p_lease_seconds IS NULL THEN
        RAISE EXCEPTION 'a hand-over needs a lease duration' USING ERRCODE = 'YX007';
    END IF;
    PERFORM set_config('yuxi.hand_over_token', p_token::text, true),
            set_config('yuxi.hand_over_lease', p_lease_seconds::text, true),
            -- The same worker as the offering run's: its host, its claimer.
            set_config('yuxi.hand_over_host', coalesce(p_offering.host_id, ''), true),
            set_config('yuxi.hand_over_claimer', coalesce(p_offering.claimer::text, ''), true),
            set_config('yuxi.hand_over_run', '', true);
END;
$$;

-- Close the offer (the completing transaction is done giving slots); returns
-- the run that took it, NULL when none did.
CREATE FUNCTION yuxi.close_hand_over_v1() RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_run uuid := nullif(current_setting('yuxi.hand_over_run', true), '')::uuid;
BEGIN
    PERFORM set_config('yuxi.hand_over_token', '', true),
            set_config('yuxi.hand_over_run', '', true);
    RETURN v_run;
END;
$$;

-- Take the open offer for p_run, a run of p_tree being given a slot: its
-- token, or NULL when there is no offer (any more) or the run may not run on
-- the offering worker's host (host affinity: the tree's runs go to the host
-- queue of its live sandbox, sql/120_hosts.sql; a worker without a host id
-- takes only runs of the shared queue), or, with p_balance, going on with it
-- would leave the claimers unbalanced (hand_over_keeps_balance_v1).
CREATE FUNCTION yuxi.take_hand_over_v1(p_tree uuid, p_run uuid,
                                       p_balance boolean DEFAULT false) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_token uuid := nullif(current_setting('yuxi.hand_over_token', true), '')::uuid;
    v_queue text;
BEGIN
    IF v_token IS NULL THEN
        RETURN NULL;
    END IF;
    v_queue := yuxi.run_queue_v1(p_tree);
    IF v_queue <> 'runs'
       AND v_queue IS DISTINCT FROM 'runs@' || yuxi.hand_over_host_v1() THEN
        RETURN NULL;
    END IF;
    IF p_balance AND NOT yuxi.hand_over_keeps_balance_v1(v_queue, p_run) THEN
        RETURN NULL;
    END IF;
    -- Taken: one run per offer (a second one would share the token).
    PERFORM set_config('yuxi.hand_over_token', '', true);
    PERFORM set_config('yuxi.hand_over_run', p_run::text, true);
    RETURN v_token;
END;
$$;

-- The lease of a run taken by a hand-over: as start_run_v1 writes it.
CREATE FUNCTION yuxi.hand_over_lease_expiry_v1() RETURNS timestamptz
    LANGUAGE sql VOLATILE AS $$
    SELECT clock_timestamp()
           + make_interval(secs => current_setting('yuxi.hand_over_lease')::double precision);
$$;

-- The host of the worker whose offer is open (NULL: none, or no host id).
CREATE FUNCTION yuxi.hand_over_host_v1() RETURNS text
    LANGUAGE sql STABLE AS $$
    SELECT nullif(current_setting('yuxi.hand_over_host', true), '');
$$;

-- The claimer (runs.claimer) of the worker whose offer is open, if it claims.
CREATE FUNCTION yuxi.hand_over_claimer_v1() RETURNS integer
    LANGUAGE sql STABLE AS $$
    SELECT nullif(current_setting('yuxi.hand_over_claimer', true), '')::integer;
$$;

-- Whether the worker whose offer is open may go on with p_run, a run of
-- queue p_queue, and keep the claimers balanced: not when it runs two or
-- more other runs and the least-loaded claimer of the queue runs fewer;
-- the run is then announced to that one (defer_run_job_v1). Chains of a
-- tree that one worker took while it was alone (its peers started later,
-- or came back) spread out at their next runs; a worker running one other
-- run never asks (a balanced fan-out's chains, two per worker, go on
-- without the check).
CREATE FUNCTION yuxi.hand_over_keeps_balance_v1(p_queue text, p_run uuid) RETURNS boolean
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_claimer integer := yuxi.hand_over_claimer_v1();
    v_load bigint;
    v_pick integer;
BEGIN
    IF v_claimer IS NULL THEN
        RETURN true;
    END IF;
    v_load := yuxi.claimer_load_v1(v_claimer);
    IF v_load < 2 THEN
        RETURN true;
    END IF;
    v_pick := yuxi.pick_claimer_v1(p_queue, p_run);
    RETURN v_pick IS NULL OR v_pick = v_claimer OR yuxi.claimer_load_v1(v_pick) >= v_load;
END;
$$;

-- A pending run gets a slot of its tree (the caller holds the tree lock):
-- leased to the worker whose offer is open while that keeps the claimers
-- balanced (take_hand_over_v1), else ready with its job deferred. (The
-- session's next turn, start_turn_run_v1, goes on where its checkpoint is,
-- balanced or not.)
CREATE FUNCTION yuxi.give_slot_v1(p_run uuid, p_tree uuid) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_token uuid := yuxi.take_hand_over_v1(p_tree, p_run, true);
BEGIN
    INSERT INTO yuxi.slot_claims (run_id, tree_id) VALUES (p_run, p_tree);
    IF v_token IS NULL THEN
        UPDATE yuxi.runs SET status = 'ready' WHERE id = p_run;
        PERFORM yuxi.defer_run_job_v1(p_run);
        RETURN;
    END IF;
    PERFORM yuxi.lease_run_v1(p_run, 'pending', v_token, yuxi.hand_over_host_v1(),
                              yuxi.hand_over_claimer_v1(), yuxi.hand_over_lease_expiry_v1(),
                              'handed_over');
END;
$$;

-- Give a slot to a pending run if the tree has one free and no older run is
-- waiting; the run becomes ready and its job is deferred. Returns true when
-- the slot was taken; otherwise the run stays pending in the FIFO.
CREATE FUNCTION yuxi.claim_slot_v1(p_run uuid) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_tree yuxi.trees;
BEGIN
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'run % not found', p_run USING ERRCODE = 'YX002';
    END IF;
    v_tree := yuxi.lock_tree_v1(v_run.tree_id);
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run FOR UPDATE;
    IF v_run.status <> 'pending' THEN
        RAISE EXCEPTION 'run % is %, only a pending run can claim a slot', p_run, v_run.status
            USING ERRCODE = 'YX001';
    END IF;
    IF (SELECT count(*) FROM yuxi.slot_claims WHERE tree_id = v_run.tree_id) >= v_tree.slot_capacity
       OR EXISTS (SELECT 1 FROM yuxi.runs
                  WHERE tree_id = v_run.tree_id AND status = 'pending'
                    AND slot_seq < v_run.slot_seq) THEN
        RETURN false;
    END IF;
    PERFORM yuxi.give_slot_v1(p_run, v_run.tree_id);
    RETURN true;
END;
$$;

-- Hand free slots of a tree to its oldest pending runs (FIFO by slot_seq), in
-- the caller's transaction. Returns how many runs got a slot.
CREATE FUNCTION yuxi.fill_slots_v1(p_tree uuid) RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    v_tree yuxi.trees;
    v_free integer;
    v_run uuid;
    v_given integer := 0;
BEGIN
    v_tree := yuxi.lock_tree_v1(p_tree);
    v_free := v_tree.slot_capacity
              - (SELECT count(*) FROM yuxi.slot_claims WHERE tree_id = p_tree);
    FOR v_run IN
        SELECT id FROM yuxi.runs
        WHERE tree_id = p_tree AND status = 'pending'
        ORDER BY slot_seq
        LIMIT greatest(v_free, 0)
        FOR UPDATE
    LOOP
        PERFORM yuxi.give_slot_v1(v_run, p_tree);
        v_given := v_given + 1;
    END LOOP;
    RETURN v_given;
END;
$$;

-- Release the slot a run holds (if any) and hand it on in the same
-- transaction. Returns true when a claim was released.
CREATE FUNCTION yuxi.release_slot_v1(p_run uuid) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    v_tree uuid;
BEGIN
    SELECT tree_id INTO v_tree FROM yuxi.runs WHERE id = p_run;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'run % not found', p_run USING ERRCODE = 'YX002';
    END IF;
    PERFORM yuxi.lock_tree_v1(v_tree);
    DELETE FROM yuxi.slot_claims WHERE run_id = p_run;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM yuxi.fill_slots_v1(v_tree);
    RETURN true;
END;
$$;
