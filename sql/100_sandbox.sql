-- The shared sandbox of a tree: its temp area and background processes, over
-- the tree's persistent workdir. A run that executes holds a lease; the
-- sandbox is released after 5 minutes idle (fixed, owned by the lease
-- service). The idle decision and a new claim serialize on a per-tree
-- advisory lock: the releaser is never called while a run of the tree is
-- active, and a claim that races a release gets a fresh generation, never a
-- half-deleted sandbox. Time is a parameter so tests need not wait.

CREATE TABLE yuxi.sandboxes (
    tree_id uuid PRIMARY KEY REFERENCES yuxi.trees (id),
    generation integer NOT NULL DEFAULT 1,
    status text NOT NULL DEFAULT 'active',
    last_activity_at timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    released_at timestamptz,
    -- The worker host whose disk holds this generation (its temp area and
    -- processes): the tree's runs go to that host's queue while it is active.
    host_id text,
    CONSTRAINT sandboxes_status_known CHECK (status IN ('active', 'released')),
    CONSTRAINT sandboxes_released_iff_released_at CHECK ((status = 'released') = (released_at IS NOT NULL)),
    CONSTRAINT sandboxes_generation_positive CHECK (generation >= 1)
);
CREATE INDEX sandboxes_idle_idx ON yuxi.sandboxes (last_activity_at) WHERE status = 'active';

-- Background processes started in a sandbox generation (killed on release).
-- `identity` (the host's boot id and the process's start time) tells the
-- recorded process from a later one that reuses its pid: a holder that died
-- and was replaced in the same generation leaves its row, and the release
-- must not kill whatever got that pid since.
CREATE TABLE yuxi.sandbox_processes (
    tree_id uuid NOT NULL REFERENCES yuxi.sandboxes (tree_id),
    generation integer NOT NULL,
    pid integer NOT NULL,
    identity text NOT NULL,
    run_id uuid NOT NULL REFERENCES yuxi.runs (id),
    command text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tree_id, generation, pid)
);
CREATE INDEX sandbox_processes_run_idx ON yuxi.sandbox_processes (run_id);

-- Claim the tree's sandbox for an executing run (fenced by its lease):
-- provision it on p_host, or a fresh generation after a release. Returns the
-- generation. A sandbox active on another host is that host's: YX008 (the
-- caller hands the run to it, yuxi.yield_run_v1).
CREATE FUNCTION yuxi.claim_sandbox_v1(p_run uuid, p_token uuid, p_now timestamptz,
                                      p_host text DEFAULT NULL)
RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    v_tree uuid;
    v_box yuxi.sandboxes;
BEGIN
    PERFORM yuxi.check_lease_v1(p_run, p_token);
    SELECT tree_id INTO v_tree FROM yuxi.runs WHERE id = p_run;
    -- The decision below reads the sandbox's state: it must not be taken
    -- while a release is deciding or deleting (that one holds this lock).
    PERFORM pg_advisory_xact_lock(yuxi.lock_key_v1('sandbox:' || v_tree));
    SELECT * INTO v_box FROM yuxi.sandboxes WHERE tree_id = v_tree;
    IF NOT FOUND THEN
        INSERT INTO yuxi.sandboxes (tree_id, last_activity_at, host_id)
        VALUES (v_tree, p_now, p_host);
        RETURN 1;
    END IF;
    IF v_box.status = 'released' THEN
        UPDATE yuxi.sandboxes
           SET generation = v_box.generation + 1, status = 'active', released_at = NULL,
               last_activity_at = p_now, host_id = p_host
         WHERE tree_id = v_tree;
        RETURN v_box.generation + 1;
    END IF;
    IF v_box.host_id IS DISTINCT FROM p_host THEN
        RAISE EXCEPTION 'the sandbox of tree % is live on host %', v_tree, v_box.host_id
            USING ERRCODE = 'YX008';
    END IF;
    UPDATE yuxi.sandboxes SET last_activity_at = greatest(last_activity_at, p_now)
     WHERE tree_id = v_tree;
    RETURN v_box.generation;
END;
$$;

-- Record activity in a tree's sandbox (a tool ran, a run ended).
CREATE FUNCTION yuxi.touch_sandbox_v1(p_tree uuid, p_now timestamptz) RETURNS void
    LANGUAGE sql AS $$
    UPDATE yuxi.sandboxes SET last_activity_at = greatest(last_activity_at, p_now)
     WHERE tree_id = p_tree AND status = 'active';
$$;

-- Decide, under the tree's sandbox lock (held until the caller's transaction
-- ends, so the caller releases files and processes while holding it),
-- whether the sandbox is idle: active, no activity for `p_idle`, and no run
-- of the tree ready or running. Returns the generation to release, or NULL.
CREATE FUNCTION yuxi.begin_sandbox_release_v1(p_tree uuid, p_now timestamptz, p_idle interval)
RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    v_box yuxi.sandboxes;
BEGIN
    PERFORM pg_advisory_xact_lock(yuxi.lock_key_v1('sandbox:' || p_tree));
    SELECT * INTO v_box FROM yuxi.sandboxes WHERE tree_id = p_tree FOR UPDATE;
    IF NOT FOUND OR v_box.status <> 'active' OR v_box.last_activity_at > p_now - p_idle
       OR EXISTS (SELECT 1 FROM yuxi.runs WHERE tree_id = p_tree
                   AND status IN ('ready', 'running')) THEN
        RETURN NULL;
    END IF;
    UPDATE yuxi.sandboxes SET status = 'released', released_at = p_now WHERE tree_id = p_tree;
    RETURN v_box.generation;
END;
$$;
