-- Real models: token usage per run and the cancel notification that lets a
-- worker abort a model call in flight (docs/models.md).

-- Add the usage of one model call to the executing run (fenced by its lease;
-- no tree lock: usage is no event).
CREATE FUNCTION yuxi.add_run_usage_v1(p_run uuid, p_token uuid, p_prompt bigint,
                                      p_completion bigint) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    UPDATE yuxi.runs SET prompt_tokens = prompt_tokens + greatest(p_prompt, 0),
                         completion_tokens = completion_tokens + greatest(p_completion, 0)
     WHERE id = p_run AND lease_token = p_token AND status = 'running'
       AND lease_expires_at > clock_timestamp();
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease of run % is lost', p_run USING ERRCODE = 'YX003';
    END IF;
END;
$$;

-- A committed cancel intent (cancel_turn_v1, stop_tree_v1) NOTIFYs
-- `yuxi_cancel` with the turn id: a worker streaming that turn's model call
-- aborts it at once instead of at the next boundary. A lost notification
-- costs latency only: the boundary check still sees the intent.
CREATE FUNCTION yuxi.notify_cancel_v1() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('yuxi_cancel', NEW.id::text);
    RETURN NULL;
END;
$$;

CREATE TRIGGER turns_cancel_notify
    AFTER UPDATE OF cancel_requested_at ON yuxi.turns
    FOR EACH ROW
    WHEN (OLD.cancel_requested_at IS NULL AND NEW.cancel_requested_at IS NOT NULL)
    EXECUTE FUNCTION yuxi.notify_cancel_v1();
