-- Named queries run by yuxi/ (loaded by yuxi/db.py). State changes go
-- through the functions of the numbered files; these only call or read.

-- Accounts -----------------------------------------------------------------

-- name: ensure_user
INSERT INTO yuxi.users (name) VALUES (%(name)s)
ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
RETURNING id;

-- name: ensure_app
INSERT INTO yuxi.apps (name) VALUES (%(name)s)
ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
RETURNING id;

-- name: insert_api_key
INSERT INTO yuxi.api_keys (user_id, app_id, key_hash, key_prefix, expires_at)
VALUES (%(user_id)s, %(app_id)s, %(key_hash)s, %(key_prefix)s,
        now() + make_interval(secs => %(lifetime_seconds)s::double precision))
RETURNING id;

-- name: authenticate
SELECT user_id, app_id FROM yuxi.api_keys
WHERE key_hash = %(key_hash)s AND revoked_at IS NULL
  AND (expires_at IS NULL OR expires_at > now());

-- name: revoke_api_key
UPDATE yuxi.api_keys SET revoked_at = now()
WHERE key_hash = %(key_hash)s AND revoked_at IS NULL;

-- Agents -------------------------------------------------------------------

-- name: insert_agent
INSERT INTO yuxi.agents (user_id, app_id, name, config)
VALUES (%(user_id)s, %(app_id)s, %(name)s, %(config)s)
RETURNING id, name, config, created_at;

-- name: upsert_agent
INSERT INTO yuxi.agents (user_id, app_id, name, config)
VALUES (%(user_id)s, %(app_id)s, %(name)s, %(config)s)
ON CONFLICT (user_id, app_id, name) DO UPDATE SET config = EXCLUDED.config
RETURNING id, name, config, created_at;

-- name: list_agents
SELECT id, name, config, created_at FROM yuxi.agents
WHERE user_id = %(user_id)s AND app_id = %(app_id)s
ORDER BY created_at, id;

-- name: get_agent
SELECT id, name, config, created_at FROM yuxi.agents
WHERE id = %(id)s AND user_id = %(user_id)s AND app_id = %(app_id)s;

-- Sessions -----------------------------------------------------------------

-- name: create_root_session
SELECT id FROM yuxi.create_root_session_v1(
    %(user_id)s, %(app_id)s, %(agent_id)s, %(title)s, %(config)s);

-- name: update_session
SELECT id FROM yuxi.update_session_v1(%(id)s, %(user_id)s, %(app_id)s, %(changes)s);

-- name: get_session
SELECT s.id, s.tree_id, s.parent_id, s.name, s.path, s.title, v.status, s.agent_id,
       s.config->>'model' AS model, s.config->>'approval_mode' AS approval_mode,
       s.created_at, v.current_turn_id, v.queue_length, v.queue_paused
FROM yuxi.sessions s
JOIN yuxi.session_status_v v ON v.session_id = s.id
WHERE s.id = %(id)s AND s.user_id = %(user_id)s AND s.app_id = %(app_id)s;

-- name: list_root_sessions
-- The first page. Later pages are list_root_sessions_after, whose keyset
-- condition is in a statement of its own: one statement with an optional
-- condition ("cursor IS NULL OR ...") gets a generic plan that cannot seek
-- the index and filters every newer row instead (37 ms at 50k rows deep,
-- against 0.85 ms). Both run in yuxi.list_root_sessions_v1, with generic
-- plans (a custom plan was re-planned at every call: see the function).
SELECT * FROM yuxi.list_root_sessions_v1(%(user_id)s, %(app_id)s, %(limit)s::integer);

-- name: list_root_sessions_after
SELECT * FROM yuxi.list_root_sessions_v1(%(user_id)s, %(app_id)s, %(limit)s::integer,
                                         %(after_created)s::timestamptz, %(after_id)s::uuid);

-- Inputs and turns ---------------------------------------------------------

-- name: receive_input
SELECT * FROM yuxi.receive_input_receipt_v1(
    %(session_id)s, %(user_id)s, %(app_id)s, %(content)s, %(mode)s, %(overrides)s,
    %(client_request_id)s, %(by_user)s);

-- name: get_input
SELECT i.id, i.session_id, i.status, i.turn_id, i.mode, i.content, i.client_request_id,
       i.context_snapshot->>'model' AS model,
       i.context_snapshot->>'approval_mode' AS approval_mode,
       i.error, i.created_at, i.started_at, i.finished_at,
       CASE WHEN t.status = 'queued' THEN
           (SELECT count(*) FROM yuxi.turns q
             WHERE q.session_id = i.session_id AND q.status = 'queued' AND q.seq < t.seq) + 1
       END AS position
FROM yuxi.inputs i
LEFT JOIN yuxi.turns t ON t.id = i.turn_id
WHERE i.id = %(id)s AND i.user_id = %(user_id)s AND i.app_id = %(app_id)s;

-- name: list_turns
SELECT t.id, t.session_id, t.input_id, t.status, t.result_run_id, t.error,
       t.created_at, t.started_at, t.finished_at
FROM yuxi.turns t
WHERE t.session_id = %(session_id)s AND t.user_id = %(user_id)s AND t.app_id = %(app_id)s
ORDER BY t.seq;

-- name: get_turn
SELECT t.id, t.session_id, t.input_id, t.status, t.result_run_id, t.error,
       t.created_at, t.started_at, t.finished_at
FROM yuxi.turns t
WHERE t.id = %(id)s AND t.user_id = %(user_id)s AND t.app_id = %(app_id)s;

-- name: runs_of_turn
SELECT id, turn_id, attempt, status, error, prompt_tokens, completion_tokens,
       created_at, started_at, finished_at
FROM yuxi.runs WHERE turn_id = %(turn_id)s
ORDER BY slot_seq;

-- name: turn_result
SELECT t.id AS turn_id, t.status, t.result_run_id AS run_id, r.output,
       coalesce(r.error, t.error) AS error
FROM yuxi.turns t
LEFT JOIN yuxi.runs r ON r.id = t.result_run_id AND r.turn_id = t.id
WHERE t.id = %(id)s AND t.user_id = %(user_id)s AND t.app_id = %(app_id)s;

-- Events -------------------------------------------------------------------

-- name: last_event_seq
SELECT coalesce(max(seq), 0) AS seq FROM yuxi.events WHERE tree_id = %(tree_id)s;

-- name: events_after
SELECT seq, type, session_id, turn_id, run_id, data, created_at
FROM yuxi.events
WHERE tree_id = %(tree_id)s AND seq > %(after)s
  AND (%(session_id)s::uuid IS NULL OR session_id = %(session_id)s::uuid)
ORDER BY seq
LIMIT %(limit)s;

-- Runs (worker side) -------------------------------------------------------

-- name: start_run
SELECT * FROM yuxi.start_run_v1(%(run_id)s, %(token)s, %(lease_seconds)s, %(mark)s, %(host)s,
                                %(claimer)s)
WHERE id IS NOT NULL;

-- name: claim_run
SELECT * FROM yuxi.claim_run_v1(%(run_id)s, %(job_id)s, %(token)s, %(lease_seconds)s,
                                %(mark)s, %(host)s, %(claimer)s)
WHERE id IS NOT NULL;

-- name: end_former_claimer
-- A worker's claims connection, made again, ends the one before it if the
-- server still holds it (the peer went silent, the server did not notice):
-- listed among the claimers (yuxi.claimers_v1), it would be announced runs
-- nobody claims. Only a backend under this connection's claimer name: a pid
-- another client has since been given is left alone.
SELECT pg_terminate_backend(pid) AS ended
FROM pg_stat_activity
WHERE pid = %(pid)s AND pid <> pg_backend_pid() AND datname = current_database()
  AND application_name = current_setting('application_name');

-- name: heartbeat_run
SELECT yuxi.heartbeat_run_v1(%(run_id)s, %(token)s, %(lease_seconds)s) AS held;

-- name: check_lease
SELECT yuxi.check_lease_v1(%(run_id)s, %(token)s);

-- name: start_tool_calls
SELECT yuxi.start_tool_calls_v1(%(run_id)s, %(token)s, %(events)s) AS started;

-- name: emit_run_events
SELECT yuxi.emit_run_events_v1(%(run_id)s, %(token)s, %(type)s, %(events)s);

-- name: emit_run_event
SELECT yuxi.emit_run_event_v1(%(run_id)s, %(token)s, %(type)s, %(data)s, %(dedupe_key)s) AS seq;

-- The archive's arrays (here and in archive_conversation) are sent in
-- binary (their placeholders end in b): psycopg sends a Python list with
-- its text array dumper otherwise, each message's bytes hex-escaped in
-- Python and parsed back on the server (131 messages of 400 bytes: 4.7 ms
-- a statement, 0.7 in binary).
-- name: complete_run
SELECT c.outcome, (c.next_run).*
FROM yuxi.complete_run_v1(%(run_id)s, %(token)s, %(output)s, %(delivered)s,
                          %(next_token)s, %(lease_seconds)s, %(events)s, %(mark)s,
                          %(archive_ids)b, %(archive_turns)b, %(archive_serde)b,
                          %(archive_messages)b) c;

-- name: mark_steers_delivered
SELECT yuxi.mark_steers_delivered_v1(%(run_id)s, %(token)s, %(input_ids)s) AS marked;

-- name: fail_run
SELECT yuxi.fail_run_v1(%(run_id)s, %(token)s, %(error)s);

-- name: expired_runs
SELECT id FROM yuxi.runs
WHERE status = 'running' AND lease_expires_at < clock_timestamp()
ORDER BY lease_expires_at
LIMIT 100;

-- name: recover_run
SELECT yuxi.recover_run_v1(%(run_id)s, %(max_attempts)s, %(max_infra_retries)s) AS new_run_id;

-- name: report_run_infra_fault
SELECT yuxi.report_run_infra_fault_v1(%(run_id)s, %(token)s, %(error)s) AS reported;

-- name: redeliver_ready_runs
SELECT yuxi.redeliver_ready_runs_v1(%(older_than)s) AS run_id;

-- Resources ----------------------------------------------------------------

-- name: ensure_resource
SELECT yuxi.ensure_resource_v1(%(app_id)s, %(kind)s, %(name)s) AS id;

-- name: grant
SELECT yuxi.grant_v1(%(user_id)s, %(app_id)s, %(kind)s, %(name)s) AS id;

-- name: revoke
SELECT yuxi.revoke_v1(%(user_id)s, %(app_id)s, %(kind)s, %(name)s) AS revoked;

-- name: resolve_resources
SELECT kind, name, resource_id, granted
FROM yuxi.resolve_resources_v1(%(user_id)s, %(app_id)s, %(selection)s)
ORDER BY kind, name;

-- name: add_note
SELECT yuxi.add_note_v1(%(run_id)s, %(token)s, %(call_id)s, %(collection)s, %(content)s) AS id;

-- name: search_notes
SELECT n.content FROM yuxi.notes n
WHERE n.resource_id = %(resource_id)s AND n.content ILIKE '%%' || %(query)s || '%%'
ORDER BY n.created_at
LIMIT 20;

-- Health -------------------------------------------------------------------

-- name: fresh_workers
SELECT count(*) AS n FROM procrastinate.procrastinate_workers
WHERE last_heartbeat > now() - make_interval(secs => %(seconds)s);

-- name: status_counts
SELECT 'sessions' AS kind, v.status AS status, count(*) AS n
  FROM yuxi.session_status_v v GROUP BY v.status
UNION ALL
SELECT 'runs', r.status, count(*) FROM yuxi.runs r GROUP BY r.status
UNION ALL
SELECT 'turns', t.status, count(*) FROM yuxi.turns t GROUP BY t.status
ORDER BY 1, 2;

-- Cooperation (tools) -------------------------------------------------------

-- name: find_effect
SELECT yuxi.find_effect_v1(%(turn_id)s, %(call_id)s, %(tool)s, %(fingerprint)s) AS result;

-- name: record_effect
SELECT yuxi.record_effect_v1(%(run_id)s, %(call_id)s, %(tool)s, %(fingerprint)s, %(result)s) AS result;

-- name: resolve_session
SELECT id, tree_id, parent_id, name, path, title FROM yuxi.resolve_session_v1(%(caller)s, %(ref)s);

-- name: create_child_session
SELECT yuxi.create_child_session_v1(%(parent)s, %(run_id)s, %(name)s, %(title)s, %(agent_id)s,
                                    %(config)s, %(task)s) AS id;

-- name: create_session_effects
SELECT yuxi.create_session_effects_v1(%(run_id)s, %(token)s, %(config)s, %(calls)s) AS results;

-- name: first_input_of
SELECT i.id AS input_id, i.turn_id, s.path FROM yuxi.inputs i JOIN yuxi.sessions s ON s.id = i.session_id
WHERE i.session_id = %(session_id)s ORDER BY i.seq LIMIT 1;

-- name: send_message
SELECT yuxi.send_message_v1(%(run_id)s, %(receiver)s, %(content)s) AS id;

-- name: cancel_turn
SELECT yuxi.cancel_turn_v1(%(user_id)s, %(app_id)s, %(session_id)s, %(turn_id)s) AS status;

-- name: cancel_requested
SELECT cancel_requested_at IS NOT NULL AS requested FROM yuxi.turns WHERE id = %(turn_id)s;

-- name: cancel_run
SELECT yuxi.cancel_run_v1(%(run_id)s, %(token)s);

-- name: finish_cancel
SELECT yuxi.finish_cancel_v1(%(turn_id)s) AS finished;

-- name: cleanup_target
SELECT id, session_id, status FROM yuxi.turns WHERE id = %(turn_id)s;

-- name: stop_tree
SELECT yuxi.stop_tree_v1(%(user_id)s, %(app_id)s, %(session_id)s) AS turns;

-- name: continue_queue
SELECT yuxi.continue_queue_v1(%(user_id)s, %(app_id)s, %(session_id)s) AS turn_id;

-- name: redeliver_cleanups
SELECT yuxi.redeliver_cleanups_v1(%(older_than)s) AS n;

-- name: session_updates
SELECT e.tree_id, e.seq, e.session_id, e.turn_id, e.type, e.data, s.path
FROM yuxi.session_updates_v1(%(waiter)s, %(targets)s, %(cursor)s) e
JOIN yuxi.sessions s ON s.id = e.session_id;

-- name: inputs_state
SELECT id AS input_id, status, turn_id, session_id FROM yuxi.inputs
WHERE id = ANY(%(ids)s) AND user_id = %(user_id)s AND app_id = %(app_id)s;

-- name: suspend_run
SELECT s.outcome, (s.next_run).*
FROM yuxi.suspend_run_v1(%(run_id)s, %(token)s, %(kind)s, %(targets)s, %(cursor)s,
                         %(timeout)s, %(next_token)s, %(lease_seconds)s, %(mark)s) s;

-- name: resume_wait
SELECT yuxi.resume_wait_v1(%(wait_id)s) AS run_id;

-- name: expire_wait
SELECT yuxi.expire_wait_v1(%(wait_id)s) AS expired;

-- name: redeliver_waits
SELECT yuxi.redeliver_waits_v1(%(grace)s) AS n;

-- name: turn_of_input_or_turn
SELECT t.id FROM yuxi.turns t
WHERE (t.id = %(id)s OR t.input_id = %(id)s
       OR t.id = (SELECT turn_id FROM yuxi.inputs WHERE id = %(id)s))
  AND t.user_id = %(user_id)s AND t.app_id = %(app_id)s
LIMIT 1;

-- name: tree_sessions
SELECT v.session_id AS id, s.parent_id, s.name, v.path, s.title, v.status, v.current_turn_id,
       v.queue_length, v.queue_paused, s.created_at
FROM yuxi.session_status_v v JOIN yuxi.sessions s ON s.id = v.session_id
WHERE v.tree_id = %(tree_id)s AND v.user_id = %(user_id)s AND v.app_id = %(app_id)s
  AND (%(parent)s::uuid IS NULL OR s.parent_id = %(parent)s::uuid)
  AND v.path > %(after)s
ORDER BY v.path
LIMIT %(limit)s;

-- name: tree_slots
SELECT slot_capacity - held AS free, held, waiting FROM yuxi.tree_slots_v WHERE tree_id = %(tree_id)s;

-- name: tree_slot_use
SELECT slot_capacity AS capacity, held, waiting FROM yuxi.tree_slots_v WHERE tree_id = %(tree_id)s;

-- name: mark_messages_processed
SELECT yuxi.mark_messages_processed_v1(%(run_id)s, %(token)s, %(message_ids)s) AS marked;

-- Waiting for a user ---------------------------------------------------------

-- name: suspend_for_user
SELECT yuxi.suspend_for_user_v1(%(run_id)s, %(token)s, %(kind)s, %(request)s) AS wait_id;

-- name: pending_user_wait
SELECT w.id, w.kind, w.request FROM yuxi.waits w
WHERE w.turn_id = %(turn_id)s AND w.user_id = %(user_id)s AND w.app_id = %(app_id)s
  AND w.status = 'pending' AND w.kind IN ('approval', 'questions');

-- name: answer_turn
SELECT yuxi.answer_turn_v1(%(user_id)s, %(app_id)s, %(turn_id)s, %(wait_id)s, %(answer)s) AS run_id;

-- Sandbox -------------------------------------------------------------------

-- name: claim_sandbox
SELECT yuxi.claim_sandbox_v1(%(run_id)s, %(token)s, %(now)s, %(host)s) AS generation;

-- name: touch_sandbox
SELECT yuxi.touch_sandbox_v1(%(tree_id)s, %(now)s);

-- name: idle_sandboxes
SELECT tree_id FROM yuxi.sandboxes
WHERE status = 'active' AND last_activity_at < %(before)s
  AND host_id IS NOT DISTINCT FROM %(host)s
ORDER BY last_activity_at LIMIT 100;

-- name: begin_sandbox_release
SELECT yuxi.begin_sandbox_release_v1(%(tree_id)s, %(now)s, %(idle)s) AS generation;

-- name: sandbox_processes
SELECT pid, identity FROM yuxi.sandbox_processes WHERE tree_id = %(tree_id)s AND generation = %(generation)s;

-- name: record_sandbox_process
INSERT INTO yuxi.sandbox_processes (tree_id, generation, pid, identity, run_id, command)
SELECT r.tree_id, %(generation)s, %(pid)s, %(identity)s, r.id, %(command)s FROM yuxi.runs r
WHERE r.id = %(run_id)s AND r.lease_token = %(token)s AND r.status = 'running';

-- name: check_grant
SELECT yuxi.check_grant_v1(%(user_id)s, %(app_id)s, %(kind)s, %(name)s) AS resource_id;

-- name: boundary
-- What a run meets before a model call: its turn's cancel intent, the steers
-- of its turn and the unprocessed messages to its session, in one round trip.
SELECT 'cancel' AS kind, NULL::uuid AS id, NULL::text AS content, NULL::text AS sender_path,
       NULL::uuid AS sender_session_id, 0::bigint AS seq
  FROM yuxi.turns WHERE id = %(turn_id)s AND cancel_requested_at IS NOT NULL
UNION ALL
SELECT 'steer', i.id, i.content, NULL, NULL, i.seq FROM yuxi.inputs i
 WHERE i.turn_id = %(turn_id)s AND i.id <> %(input_id)s
UNION ALL
SELECT 'message', m.id, m.content, s.path, m.sender_session_id, m.seq
  FROM yuxi.messages m JOIN yuxi.sessions s ON s.id = m.sender_session_id
 WHERE m.receiver_session_id = %(session_id)s AND m.processed_at IS NULL
ORDER BY 1, 6;

-- Retention ----------------------------------------------------------------

-- name: trees_with_events_before
SELECT id FROM yuxi.trees t
WHERE EXISTS (SELECT 1 FROM yuxi.events e WHERE e.tree_id = t.id AND e.created_at < %(before)s)
ORDER BY id;

-- name: prune_tree_events
SELECT yuxi.prune_tree_events_v1(%(tree_id)s, %(before)s) AS deleted;

-- Worker hosts ----------------------------------------------------------------

-- name: host_heartbeat
SELECT yuxi.host_heartbeat_v1(%(host)s);

-- name: release_dead_hosts
SELECT yuxi.release_dead_hosts_v1(%(timeout)s) AS released;

-- name: yield_run
SELECT yuxi.yield_run_v1(%(run_id)s, %(token)s) AS queue;

-- Metrics (yuxi/metrics.py; docs/operator-guide.md shows each) -----------------

-- name: metrics_queue_depth
SELECT queue_name AS queue, count(*) AS n FROM procrastinate.procrastinate_jobs
WHERE status = 'todo' GROUP BY queue_name;

-- name: metrics_pending_runs
SELECT tree_id, count(*) AS n FROM yuxi.runs WHERE status = 'pending' GROUP BY tree_id;

-- name: metrics_slots
SELECT (SELECT count(*) FROM yuxi.slot_claims) AS held,
       (SELECT count(*) FROM yuxi.tree_slots_v WHERE held >= slot_capacity) AS full_trees;

-- name: metrics_stuck_runs
SELECT (SELECT count(*) FROM yuxi.runs
         WHERE status = 'running' AND lease_expires_at < clock_timestamp()) AS lease_expired,
       (SELECT count(*) FROM yuxi.runs r
         WHERE r.status = 'ready' AND r.created_at < now() - interval '30 seconds'
           AND NOT EXISTS (SELECT 1 FROM procrastinate.procrastinate_jobs j
                            WHERE j.task_name = 'execute_run' AND j.status IN ('todo', 'doing')
                              AND j.args->>'run_id' = r.id::text)) AS ready_without_job;

-- name: metrics_turn_duration
SELECT status, extract(epoch FROM finished_at - created_at)::float8 AS seconds
FROM yuxi.turns WHERE id = %(turn_id)s AND finished_at IS NOT NULL;

-- Models ---------------------------------------------------------------------

-- name: add_run_usage
SELECT yuxi.add_run_usage_v1(%(run_id)s, %(token)s, %(prompt)s, %(completion)s);

-- name: notify_delta
-- Only while someone watches the tree (yuxi.event_watches): no watcher, no
-- notifying commit.
SELECT pg_notify('yuxi_deltas', %(payload)s) WHERE yuxi.events_watched_v1(%(tree_id)s);

-- name: watch_events
SELECT yuxi.watch_events_v1(%(tree_id)s, %(pid)s);

-- name: unwatch_events
SELECT yuxi.unwatch_events_v1(%(tree_id)s, %(pid)s);

-- name: forget_watches
SELECT yuxi.forget_watches_v1(%(pid)s) AS forgotten;

-- name: session_usage
SELECT coalesce(sum(r.prompt_tokens), 0)::bigint AS prompt_tokens,
       coalesce(sum(r.completion_tokens), 0)::bigint AS completion_tokens
FROM yuxi.turns t JOIN yuxi.runs r ON r.turn_id = t.id
WHERE t.session_id = %(session_id)s AND t.user_id = %(user_id)s AND t.app_id = %(app_id)s;

-- name: tree_usage
SELECT coalesce(sum(r.prompt_tokens), 0)::bigint AS prompt_tokens,
       coalesce(sum(r.completion_tokens), 0)::bigint AS completion_tokens
FROM yuxi.sessions s JOIN yuxi.turns t ON t.session_id = s.id
JOIN yuxi.runs r ON r.turn_id = t.id
WHERE s.tree_id = %(tree_id)s AND s.user_id = %(user_id)s AND s.app_id = %(app_id)s;
-- Conversation (sql/140_conversation.sql) ------------------------------------

-- Archive what an earlier turn left in the checkpoint (if anything) and
-- read the history a run gives its model: one round trip, one index range
-- scan.
-- name: archive_conversation
SELECT message_id, serde, message FROM yuxi.archive_conversation_v1(
    %(run_id)s, %(token)s, %(ids)b, %(turns)b, %(serde)b, %(messages)b);

-- A page of the archive, newest first, before a position (the keyset
-- cursor; the caller passes the largest integer for "from the end"): a
-- backward range scan of the primary key, `limit` rows.
-- name: conversation_page
SELECT position, message_id, serde, message FROM yuxi.conversation
WHERE session_id = %(session_id)s AND position < %(before)s
ORDER BY position DESC LIMIT %(limit)s;

-- The archive of a run's session, oldest first: what a turn's model sees
-- before the checkpoint's messages, past a position (what the worker holds
-- decoded already: its archive cache). Keyed by the run: a claim reads it
-- with the lease, knowing the run's id only.
-- name: conversation_history
SELECT message_id, serde, message FROM yuxi.conversation
WHERE session_id = (SELECT session_id FROM yuxi.runs WHERE id = %(run_id)s)
  AND position > %(after)s
ORDER BY position;

-- The archive's last row: where the checkpoint's messages continue, and
-- whether they are archived already.
-- name: conversation_last
SELECT position, message_id FROM yuxi.conversation
WHERE session_id = %(session_id)s ORDER BY position DESC LIMIT 1;

-- A LISTEN connection's TCP keepalives and user timeout (db.listen_forever),
-- for this session only; ignored on a Unix socket.
-- name: listener_timeouts
SELECT set_config('tcp_keepalives_idle', %(idle)s, false),
       set_config('tcp_keepalives_interval', %(interval)s, false),
       set_config('tcp_keepalives_count', %(count)s, false),
       set_config('tcp_user_timeout', %(user_timeout)s, false);
