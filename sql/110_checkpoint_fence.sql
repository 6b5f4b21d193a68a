-- Checkpoint writes of an executing run are fenced by its lease inside
-- PostgreSQL: the worker marks the connection it lends the run's checkpointer
-- (`yuxi.run_id`, `yuxi.lease_token`, session settings), and every
-- transaction writing LangGraph's tables on it first checks the lease
-- (share-locking the run row until the write commits). A worker that lost
-- its lease writes nothing; other connections (the API, the cancel cleanup)
-- are not marked.

-- Mark the caller's connection with a run's lease for its checkpointer (empty
-- strings unmark it): session settings, kept after the transaction commits
-- and undone if it aborts.
CREATE FUNCTION yuxi.mark_checkpoint_connection_v1(p_run text, p_token text) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('yuxi.run_id', p_run, false), set_config('yuxi.lease_token', p_token, false);
END;
$$;

-- Statement trigger of the checkpoint tables.
CREATE FUNCTION yuxi.fence_checkpoint_write_v1() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    v_run text := current_setting('yuxi.run_id', true);
BEGIN
    -- Once per transaction: the first check share-locks the run row until
    -- the transaction ends, which covers its later statements.
    IF coalesce(v_run, '') <> ''
       AND current_setting('yuxi.lease_checked', true) IS DISTINCT FROM v_run THEN
        PERFORM yuxi.check_lease_v1(v_run::uuid,
                                    current_setting('yuxi.lease_token', true)::uuid);
        PERFORM set_config('yuxi.lease_checked', v_run, true);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER checkpoints_fence BEFORE INSERT OR UPDATE OR DELETE ON langgraph.checkpoints
    FOR EACH STATEMENT EXECUTE FUNCTION yuxi.fence_checkpoint_write_v1();
CREATE TRIGGER checkpoint_blobs_fence BEFORE INSERT OR UPDATE OR DELETE ON langgraph.checkpoint_blobs
    FOR EACH STATEMENT EXECUTE FUNCTION yuxi.fence_checkpoint_write_v1();
CREATE TRIGGER checkpoint_writes_fence BEFORE INSERT OR UPDATE OR DELETE ON langgraph.checkpoint_writes
    FOR EACH STATEMENT EXECUTE FUNCTION yuxi.fence_checkpoint_write_v1();

-- Superseded checkpoints of a session's thread: everything but the latest
-- checkpoint, its pending writes and the blobs it references. LangGraph
-- stores a channel's whole value at each version (the message list at every
-- step), so a thread kept whole grows with the square of its history; pruned,
-- with its length. Only what resumes a thread is ever read: the latest
-- checkpoint and its writes (a run, a wait's resume and a cancel's cleanup
-- all start there). Called by the run that completes its turn, under its
-- lease: no other writer of the thread can run meanwhile.
CREATE FUNCTION yuxi.prune_checkpoints_v1(p_thread text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_latest langgraph.checkpoints;
BEGIN
    SELECT * INTO v_latest FROM langgraph.checkpoints
     WHERE thread_id = p_thread AND checkpoint_ns = ''
     ORDER BY checkpoint_id DESC LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    DELETE FROM langgraph.checkpoint_writes
     WHERE thread_id = p_thread AND checkpoint_ns = '' AND checkpoint_id < v_latest.checkpoint_id;
    DELETE FROM langgraph.checkpoints
     WHERE thread_id = p_thread AND checkpoint_ns = '' AND checkpoint_id < v_latest.checkpoint_id;
    DELETE FROM langgraph.checkpoint_blobs b
     WHERE b.thread_id = p_thread AND b.checkpoint_ns = ''
       AND (v_latest.checkpoint->'channel_versions'->>b.channel) IS DISTINCT FROM b.version;
END;
$$;
