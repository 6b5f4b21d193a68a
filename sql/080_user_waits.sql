-- Waiting for a user: approvals of side-effecting tool calls (approval mode
-- "confirm") and questions (the ask_user tool). The run suspends like a
-- cooperation wait, but the turn is `waiting_user` (new input is refused
-- with YX005) and only an answer through the API resumes it.

ALTER TABLE yuxi.waits DROP CONSTRAINT waits_kind_known;
ALTER TABLE yuxi.waits ADD CONSTRAINT waits_kind_known
    CHECK (kind IN ('sessions', 'inputs', 'approval', 'questions'));
ALTER TABLE yuxi.waits DROP CONSTRAINT waits_has_targets;
ALTER TABLE yuxi.waits ADD CONSTRAINT waits_has_targets
    CHECK (kind IN ('approval', 'questions') OR cardinality(targets) > 0);
-- The pending request shown to the user, and the answer that resolved it
-- (values by interrupt id).
ALTER TABLE yuxi.waits ADD COLUMN request jsonb;
ALTER TABLE yuxi.waits ADD COLUMN answer jsonb;
ALTER TABLE yuxi.waits ADD CONSTRAINT waits_user_has_request
    CHECK (kind NOT IN ('approval', 'questions') OR request IS NOT NULL);

-- Suspend the run until its user answers: store the request, release the
-- slot (the job ends), put the turn in `waiting_user`.
CREATE FUNCTION yuxi.suspend_for_user_v1(p_run uuid, p_token uuid, p_kind text, p_request jsonb)
RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_wait uuid;
BEGIN
    v_run := yuxi.fence_run_v1(p_run, p_token);
    INSERT INTO yuxi.waits (run_id, turn_id, session_id, tree_id, user_id, app_id, kind,
                            targets, deadline, request)
    VALUES (p_run, v_run.turn_id, v_run.session_id, v_run.tree_id, v_run.user_id,
            v_run.app_id, p_kind, '{}', 'infinity', p_request)
    RETURNING id INTO v_wait;
    UPDATE yuxi.runs SET status = 'suspended', finished_at = now() WHERE id = p_run;
    UPDATE yuxi.turns SET status = 'waiting_user' WHERE id = v_run.turn_id;
    PERFORM yuxi.release_slot_v1(p_run);
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'run.suspended', jsonb_build_object('wait_id', v_wait,
                                                                  'kind', p_kind));
    PERFORM yuxi.emit_event_v1(v_run.tree_id, v_run.session_id, v_run.turn_id, p_run,
                               'turn.waiting_user',
                               jsonb_build_object('wait_id', v_wait, 'pending',
                                                  p_request || jsonb_build_object('kind', p_kind)));
    RETURN v_wait;
END;
$$;

-- The user's answer (already validated against the request): resolve the
-- wait once and resume the same turn in a new run. A second answer, or one
-- for a turn that is not waiting for its user, is refused (YX001).
CREATE FUNCTION yuxi.answer_turn_v1(p_user uuid, p_app uuid, p_turn uuid, p_wait uuid,
                                    p_answer jsonb) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_wait yuxi.waits;
BEGIN
    SELECT * INTO v_wait FROM yuxi.waits
     WHERE id = p_wait AND turn_id = p_turn AND user_id = p_user AND app_id = p_app;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'turn % has no such request', p_turn USING ERRCODE = 'YX002';
    END IF;
    PERFORM yuxi.lock_tree_v1(v_wait.tree_id);
    UPDATE yuxi.waits SET status = 'satisfied', reason = 'answered', answer = p_answer,
                          resolved_at = now()
     WHERE id = p_wait AND status = 'pending'
       AND EXISTS (SELECT 1 FROM yuxi.turns WHERE id = p_turn AND status = 'waiting_user');
    IF NOT FOUND THEN
        RAISE EXCEPTION 'turn % is not waiting for an answer', p_turn USING ERRCODE = 'YX001';
    END IF;
    PERFORM yuxi.emit_event_v1(v_wait.tree_id, v_wait.session_id, p_turn, NULL,
                               'turn.answered', jsonb_build_object('wait_id', p_wait));
    RETURN yuxi.resume_wait_v1(p_wait);
END;
$$;
