-- Operator views: what psql users read (see docs/operator-guide.md).

-- Each session with its derived status and queue summary.
CREATE VIEW yuxi.session_status_v AS
SELECT s.id AS session_id, s.tree_id, s.parent_id, s.user_id, s.app_id, s.path, s.title,
       coalesce(CASE a.status WHEN 'cancelling' THEN 'running' ELSE a.status END, 'idle')
           AS status,
       a.id AS current_turn_id,
       (SELECT count(*) FROM yuxi.turns q WHERE q.session_id = s.id AND q.status = 'queued')
           AS queue_length,
       s.queue_paused,
       s.created_at
  FROM yuxi.sessions s
  LEFT JOIN yuxi.turns a
    ON a.session_id = s.id AND a.status IN ('running', 'waiting', 'waiting_user', 'cancelling');

-- Slot use per tree: holders, runs waiting for a slot, capacity.
CREATE VIEW yuxi.tree_slots_v AS
SELECT t.id AS tree_id, t.slot_capacity,
       (SELECT count(*) FROM yuxi.slot_claims c WHERE c.tree_id = t.id) AS held,
       (SELECT count(*) FROM yuxi.runs r WHERE r.tree_id = t.id AND r.status = 'pending')
           AS waiting
  FROM yuxi.trees t;

-- Runs that are executing, with their lease state.
CREATE VIEW yuxi.live_runs_v AS
SELECT r.id AS run_id, r.turn_id, r.session_id, r.tree_id, r.status, r.attempt,
       r.lease_expires_at, r.lease_expires_at < clock_timestamp() AS lease_expired,
       r.created_at, r.started_at
  FROM yuxi.runs r
 WHERE r.status IN ('pending', 'ready', 'running');
