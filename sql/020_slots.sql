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
    LANGUAGE plpgsql
    SET search_path = procrastinate, pg_catalog
AS $$
BEGIN
    RETURN (procrastinate_defer_jobs_v1(ARRAY[ROW(
        yuxi.run_queue_v1((SELECT tree_id FROM yuxi.runs WHERE id = p_run)), 'execute_run',
        0, NULL, NULL,
        jsonb_build_object('run_id', p_run), NULL
    )::procrastinate_job_to_defer_v1]))[1];
END;
$$;

-- A run of the tree that is being created can have a slot at once: one is
-- free and no run waits in the tree's FIFO. The caller holds the tree lock.
CREATE FUNCTION yuxi.slot_free_v1(p_tree yuxi.trees) RETURNS boolean
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT count(*) FROM yuxi.slot_claims WHERE tree_id = p_tree.id) < p_tree.slot_capacity
       AND NOT EXISTS (SELECT 1 FROM yuxi.runs WHERE tree_id = p_tree.id AND status = 'pending');
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
    INSERT INTO yuxi.slot_claims (run_id, tree_id) VALUES (p_run, v_run.tree_id);
    UPDATE yuxi.runs SET status = 'ready' WHERE id = p_run;
    PERFORM yuxi.defer_run_job_v1(p_run);
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
        INSERT INTO yuxi.slot_claims (run_id, tree_id) VALUES (v_run, p_tree);
        UPDATE yuxi.runs SET status = 'ready' WHERE id = v_run;
        PERFORM yuxi.defer_run_job_v1(v_run);
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
