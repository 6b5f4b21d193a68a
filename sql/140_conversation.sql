-- The conversation of a session, kept out of LangGraph's checkpoints.
--
-- LangGraph writes a channel's whole value at every checkpoint; holding the
-- session's whole conversation in the `messages` channel made every step of a
-- turn rewrite the whole history (bytes written per turn grew with it). The
-- checkpoint now holds only the messages since the last turn start (the turn
-- in flight, or the last turn that ran); the turns before it are rows here,
-- one per message, written once.
--
-- A completed turn's messages are archived by its completion, in the
-- transaction of complete_run_v1. A turn that ends otherwise (failed, out of
-- steps, cancelled and cleaned, given up by recovery) leaves them in the
-- checkpoint; the next turn's first invocation archives what the checkpoint
-- holds (nothing new when its turn completed) and only then writes the
-- checkpoint that forgets it (its input starts with RemoveMessage of all).
-- Those two commits are ordered, not atomic, and each is safe to repeat: a
-- run killed between them finds the same messages in the checkpoint and the
-- archive already holding them (its last row is their last message), so the
-- archive is written once and nothing is lost. Readers (the API) skip the
-- checkpoint's messages by the same rule.

CREATE TABLE yuxi.conversation (
    session_id uuid NOT NULL REFERENCES yuxi.sessions (id),
    -- 1, 2, 3, ... per session, gap-free, in conversation order: the
    -- keyset cursor of GET /api/sessions/{id}/messages (`before`).
    position integer NOT NULL,
    message_id text NOT NULL,
    -- The turn whose conversation held the message (from its turn-start
    -- input), NULL for messages before any marked turn start.
    turn_id uuid,
    -- The message as LangGraph's serializer writes it into a checkpoint
    -- (JsonPlusSerializer.dumps_typed: its type tag and bytes): the model
    -- sees exactly what it saw when the message was in the checkpoint, and
    -- bytea keeps what text/jsonb cannot (NUL characters in tool output).
    serde text NOT NULL,
    message bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, position)
);

-- Append a batch of a session's messages to its archive. The caller holds
-- the lease of the session's running turn (only that run writes here, so no
-- two writers race for positions): archive_conversation_v1 checks it, and
-- complete_run_v1 has fenced its run already. Idempotent: when the archive's
-- last row is the batch's last message, the batch is there already (a retry
-- after a crash between this commit and the checkpoint's reset) and nothing
-- is written.
CREATE FUNCTION yuxi.append_conversation_v1(
    p_session uuid, p_ids text[], p_turns uuid[], p_serde text[], p_messages bytea[]
) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    v_last yuxi.conversation;
    v_count integer := coalesce(array_length(p_ids, 1), 0);
BEGIN
    IF v_count = 0 THEN
        RETURN;
    END IF;
    SELECT * INTO v_last FROM yuxi.conversation c
     WHERE c.session_id = p_session ORDER BY c.position DESC LIMIT 1;
    IF FOUND AND v_last.message_id = p_ids[v_count] THEN
        RETURN;  -- archived already
    END IF;
    INSERT INTO yuxi.conversation (session_id, position, message_id, turn_id, serde, message)
    SELECT p_session, coalesce(v_last.position, 0) + m.n, m.id, m.turn, m.serde, m.message
      FROM unnest(p_ids, p_turns, p_serde, p_messages) WITH ORDINALITY
           AS m(id, turn, serde, message, n);
END;
$$;

-- Archive the messages of an earlier turn that the checkpoint still holds,
-- fenced by the run's lease (like the checkpoint writes: a worker that lost
-- its lease writes nothing), then return the session's archived history in
-- order: one round trip at a run's start. With empty arrays it only reads
-- (and takes no lock).
CREATE FUNCTION yuxi.archive_conversation_v1(
    p_run uuid, p_token uuid, p_ids text[], p_turns uuid[], p_serde text[], p_messages bytea[]
) RETURNS TABLE (message_id text, serde text, message bytea)
    LANGUAGE plpgsql AS $$
DECLARE
    v_session uuid;
BEGIN
    IF coalesce(array_length(p_ids, 1), 0) > 0 THEN
        PERFORM yuxi.check_lease_v1(p_run, p_token);
    END IF;
    SELECT r.session_id INTO v_session FROM yuxi.runs r WHERE r.id = p_run;
    PERFORM yuxi.append_conversation_v1(v_session, p_ids, p_turns, p_serde, p_messages);
    RETURN QUERY SELECT c.message_id, c.serde, c.message FROM yuxi.conversation c
                  WHERE c.session_id = v_session ORDER BY c.position;
END;
$$;
