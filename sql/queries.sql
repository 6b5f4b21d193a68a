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
INSERT INTO yuxi.api_keys (user_id, app_id, key_hash, key_prefix)
VALUES (%(user_id)s, %(app_id)s, %(key_hash)s, %(key_prefix)s)
RETURNING id;

-- name: authenticate
SELECT user_id, app_id FROM yuxi.api_keys
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
SELECT s.id, s.tree_id, s.parent_id, s.name, s.path, s.title, v.status, s.agent_id,
       s.config->>'model' AS model, s.config->>'approval_mode' AS approval_mode,
       s.created_at, v.current_turn_id, v.queue_length, v.queue_paused
FROM yuxi.sessions s
JOIN yuxi.session_status_v v ON v.session_id = s.id
WHERE s.user_id = %(user_id)s AND s.app_id = %(app_id)s AND s.parent_id IS NULL
  AND (%(after_created)s::timestamptz IS NULL
       OR (s.created_at, s.id) < (%(after_created)s::timestamptz, %(after_id)s::uuid))
ORDER BY s.created_at DESC, s.id DESC
LIMIT %(limit)s;

-- name: session_identity
SELECT id, name, path, parent_id, tree_id FROM yuxi.sessions WHERE id = %(id)s;

-- Inputs and turns ---------------------------------------------------------

-- name: receive_input
SELECT yuxi.receive_input_v1(%(session_id)s, %(user_id)s, %(app_id)s, %(content)s,
                             %(mode)s, %(overrides)s, %(client_request_id)s) AS input_id;

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
SELECT id, turn_id, attempt, status, error, created_at, started_at, finished_at
FROM yuxi.runs WHERE turn_id = %(turn_id)s
ORDER BY slot_seq;

-- name: turn_result
SELECT t.id AS turn_id, t.status, t.result_run_id AS run_id, r.output,
       coalesce(r.error, t.error) AS error
FROM yuxi.turns t
LEFT JOIN yuxi.runs r ON r.id = t.result_run_id AND r.turn_id = t.id
WHERE t.id = %(id)s AND t.user_id = %(user_id)s AND t.app_id = %(app_id)s;

-- Events -------------------------------------------------------------------

-- name: events_after
SELECT seq, type, session_id, turn_id, run_id, data, created_at
FROM yuxi.events
WHERE tree_id = %(tree_id)s AND seq > %(after)s
  AND (%(session_id)s::uuid IS NULL OR session_id = %(session_id)s::uuid)
ORDER BY seq
LIMIT %(limit)s;

-- Runs (worker side) -------------------------------------------------------

-- name: start_run
SELECT r.id, r.turn_id, r.session_id, r.tree_id, r.user_id, r.app_id, r.attempt, r.config,
       t.input_id, i.content AS input_content,
       s.name AS session_name, s.path AS session_path, s.parent_id AS session_parent_id
FROM yuxi.start_run_v1(%(run_id)s, %(token)s, %(lease_seconds)s) r
JOIN yuxi.turns t ON t.id = r.turn_id
JOIN yuxi.inputs i ON i.id = t.input_id
JOIN yuxi.sessions s ON s.id = r.session_id
WHERE r.id IS NOT NULL;

-- name: heartbeat_run
SELECT yuxi.heartbeat_run_v1(%(run_id)s, %(token)s, %(lease_seconds)s) AS held;

-- name: check_lease
SELECT yuxi.check_lease_v1(%(run_id)s, %(token)s);

-- name: emit_run_event
SELECT yuxi.emit_run_event_v1(%(run_id)s, %(token)s, %(type)s, %(data)s, %(dedupe_key)s) AS seq;

-- name: complete_run
SELECT yuxi.complete_run_v1(%(run_id)s, %(token)s, %(output)s, %(delivered)s) AS completed;

-- name: turn_steers
SELECT id, content FROM yuxi.inputs
WHERE turn_id = %(turn_id)s AND id <> %(input_id)s
ORDER BY seq;

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
SELECT yuxi.recover_run_v1(%(run_id)s, %(max_attempts)s) AS new_run_id;

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
