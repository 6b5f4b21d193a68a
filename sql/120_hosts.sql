-- Worker hosts and sandbox affinity. Workers on several hosts share this
-- database; each has a host identity (YUXI_HOST_ID) and its own data
-- directory. A tree's live sandbox (temp area, background processes, and the
-- workdir unless the data directory is shared) is on one host's disk, so
-- while it is active the tree's runs go to that host's Procrastinate queue
-- `runs@<host>`; a tree without one runs anywhere (`runs`). A host whose
-- heartbeat expired releases its sandboxes (the sweep below): the tree's
-- next run goes anywhere and provisions a fresh generation there.

CREATE TABLE yuxi.hosts (
    host_id text PRIMARY KEY,
    heartbeat_at timestamptz NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT hosts_id_shape CHECK (host_id ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$')
);

-- A worker process of the host is alive (every few seconds, from each one).
CREATE FUNCTION yuxi.host_heartbeat_v1(p_host text) RETURNS void
    LANGUAGE sql AS $$
    INSERT INTO yuxi.hosts (host_id, heartbeat_at) VALUES (p_host, clock_timestamp())
    ON CONFLICT (host_id) DO UPDATE SET heartbeat_at = greatest(yuxi.hosts.heartbeat_at,
                                                                 excluded.heartbeat_at);
$$;

-- The Procrastinate queue of a tree's runs: its live sandbox's host queue,
-- else the shared one.
CREATE FUNCTION yuxi.run_queue_v1(p_tree uuid) RETURNS text
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_host text;
BEGIN
    SELECT host_id INTO v_host FROM yuxi.sandboxes
     WHERE tree_id = p_tree AND status = 'active';
    RETURN coalesce('runs@' || v_host, 'runs');
END;
$$;

-- Give a leased run back (it met its tree's sandbox live on another host,
-- YX008): ready again, its job deferred to the holder's queue. Fenced by the
-- lease; the run keeps its attempt and its slot. Returns the queue.
CREATE FUNCTION yuxi.yield_run_v1(p_run uuid, p_token uuid) RETURNS text
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
BEGIN
    v_run := yuxi.fence_run_v1(p_run, p_token);
    UPDATE yuxi.runs SET status = 'ready', lease_token = NULL, lease_expires_at = NULL
     WHERE id = p_run;
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'run.moved', jsonb_build_object(
                                   'from', v_run.host_id, 'queue', yuxi.run_queue_v1(v_run.tree_id)));
    PERFORM yuxi.defer_run_job_v1(p_run);
    RETURN yuxi.run_queue_v1(v_run.tree_id);
END;
$$;

-- The hosts sweep (any worker, every few seconds): every active sandbox of a
-- host whose heartbeat is older than p_timeout (or that never sent one) is
-- released, under the tree's sandbox lock, so the tree runs anywhere again;
-- execute_run jobs waiting in a dead host's queue move to the shared queue.
-- Its processes and temp files died with the host (or are the host's to
-- delete when it comes back: its data directory is its own). Returns the
-- sandboxes released.
CREATE FUNCTION yuxi.release_dead_hosts_v1(p_timeout interval) RETURNS integer
    LANGUAGE plpgsql
    SET search_path = procrastinate, pg_catalog
AS $$
DECLARE
    v_tree uuid;
    v_released integer := 0;
BEGIN
    FOR v_tree IN
        SELECT s.tree_id FROM yuxi.sandboxes s
         WHERE s.status = 'active' AND s.host_id IS NOT NULL
           AND NOT yuxi.host_alive_v1(s.host_id, p_timeout)
    LOOP
        PERFORM pg_advisory_xact_lock(yuxi.lock_key_v1('sandbox:' || v_tree));
        UPDATE yuxi.sandboxes SET status = 'released', released_at = now()
         WHERE tree_id = v_tree AND status = 'active' AND host_id IS NOT NULL
           AND NOT yuxi.host_alive_v1(host_id, p_timeout);
        IF FOUND THEN
            v_released := v_released + 1;
        END IF;
    END LOOP;
    UPDATE procrastinate_jobs SET queue_name = 'runs'
     WHERE status = 'todo' AND task_name = 'execute_run' AND queue_name LIKE 'runs@%'
       AND NOT yuxi.host_alive_v1(substr(queue_name, 6), p_timeout);
    RETURN v_released;
END;
$$;

-- A host is alive while its last heartbeat is younger than p_timeout.
CREATE FUNCTION yuxi.host_alive_v1(p_host text, p_timeout interval) RETURNS boolean
    LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM yuxi.hosts
                    WHERE host_id = p_host AND heartbeat_at > clock_timestamp() - p_timeout);
$$;

-- Operators: hosts, their liveness and the sandboxes and queued runs they hold.
CREATE VIEW yuxi.hosts_v AS
SELECT h.host_id, h.heartbeat_at, clock_timestamp() - h.heartbeat_at AS silent_for,
       (SELECT count(*) FROM yuxi.sandboxes s
         WHERE s.host_id = h.host_id AND s.status = 'active') AS live_sandboxes
  FROM yuxi.hosts h;
