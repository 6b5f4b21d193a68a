-- Yuxi sessions: tables of schema `yuxi` (fresh-only: applied once to an empty
-- schema; see yuxi/schema.py for the version check).
--
-- Ownership columns (tree_id, user_id, app_id) are repeated on every child row
-- on purpose: composite foreign keys then make a row whose tree or scope differs
-- from its parent's impossible, not just unlikely.

CREATE SCHEMA yuxi;

-- One row: the schema version this database was created with.
CREATE TABLE yuxi.meta (
    singleton boolean PRIMARY KEY DEFAULT true,
    schema_version text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT meta_singleton CHECK (singleton)
);

CREATE TABLE yuxi.users (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT users_name_not_blank CHECK (btrim(name) <> '')
);

CREATE TABLE yuxi.apps (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT apps_name_not_blank CHECK (btrim(name) <> '')
);

-- Keys are stored as sha256 digests; the clear key is shown once at creation.
CREATE TABLE yuxi.api_keys (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    user_id uuid NOT NULL REFERENCES yuxi.users (id),
    app_id uuid NOT NULL REFERENCES yuxi.apps (id),
    key_hash bytea NOT NULL UNIQUE,
    key_prefix text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    -- NULL: until revoked (API keys). A web sign-in's minted key expires with
    -- its cookie, so one abandoned without signing out stops working too.
    expires_at timestamptz,
    CONSTRAINT api_keys_hash_is_sha256 CHECK (length(key_hash) = 32)
);
CREATE INDEX api_keys_user_app_idx ON yuxi.api_keys (user_id, app_id);
CREATE INDEX api_keys_app_idx ON yuxi.api_keys (app_id);

CREATE TABLE yuxi.agents (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    user_id uuid NOT NULL REFERENCES yuxi.users (id),
    app_id uuid NOT NULL REFERENCES yuxi.apps (id),
    name text NOT NULL,
    config jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT agents_name_not_blank CHECK (btrim(name) <> ''),
    CONSTRAINT agents_config_is_object CHECK (jsonb_typeof(config) = 'object'),
    CONSTRAINT agents_name_unique_in_scope UNIQUE (user_id, app_id, name),
    CONSTRAINT agents_id_scope_key UNIQUE (id, user_id, app_id)
);
CREATE INDEX agents_app_idx ON yuxi.agents (app_id);

-- A tree is the creation relation of sessions; its id is the root session's id.
-- The tree row is the lock every transition of the tree takes first: it orders
-- events (their seq is taken under it) and guards the shared slots.
CREATE TABLE yuxi.trees (
    id uuid PRIMARY KEY,
    user_id uuid NOT NULL REFERENCES yuxi.users (id),
    app_id uuid NOT NULL REFERENCES yuxi.apps (id),
    slot_capacity integer NOT NULL DEFAULT 4,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT trees_slot_capacity_range CHECK (slot_capacity BETWEEN 1 AND 64),
    CONSTRAINT trees_id_scope_key UNIQUE (id, user_id, app_id)
);
CREATE INDEX trees_user_app_idx ON yuxi.trees (user_id, app_id);
CREATE INDEX trees_app_idx ON yuxi.trees (app_id);

CREATE TABLE yuxi.sessions (
    id uuid PRIMARY KEY,
    tree_id uuid NOT NULL,
    parent_id uuid,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    agent_id uuid,
    name text NOT NULL,
    path text NOT NULL,
    title text,
    config jsonb NOT NULL,
    queue_paused boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT sessions_tree_scope_fk FOREIGN KEY (tree_id, user_id, app_id)
        REFERENCES yuxi.trees (id, user_id, app_id),
    -- A child must live in its parent's tree and scope.
    CONSTRAINT sessions_parent_same_tree_fk FOREIGN KEY (parent_id, tree_id, user_id, app_id)
        REFERENCES yuxi.sessions (id, tree_id, user_id, app_id),
    CONSTRAINT sessions_agent_scope_fk FOREIGN KEY (agent_id, user_id, app_id)
        REFERENCES yuxi.agents (id, user_id, app_id),
    CONSTRAINT sessions_id_tree_scope_key UNIQUE (id, tree_id, user_id, app_id),
    -- Paths are unique in a tree, so names are unique per parent.
    CONSTRAINT sessions_path_unique_in_tree UNIQUE (tree_id, path),
    CONSTRAINT sessions_root_is_tree CHECK ((parent_id IS NULL) = (id = tree_id)),
    CONSTRAINT sessions_name_valid CHECK (
        name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$' AND name NOT IN ('.', '..')),
    CONSTRAINT sessions_path_ends_with_name CHECK (
        path = '/' || name OR right(path, length(name) + 1) = '/' || name),
    CONSTRAINT sessions_root_path CHECK (parent_id IS NOT NULL OR path = '/' || name),
    CONSTRAINT sessions_config_is_object CHECK (jsonb_typeof(config) = 'object')
);
-- Top-level listing: roots of one scope, newest first.
CREATE INDEX sessions_roots_idx ON yuxi.sessions (user_id, app_id, created_at DESC, id DESC)
    WHERE parent_id IS NULL;
CREATE INDEX sessions_parent_idx ON yuxi.sessions (parent_id, tree_id, user_id, app_id)
    WHERE parent_id IS NOT NULL;
CREATE INDEX sessions_agent_idx ON yuxi.sessions (agent_id, user_id, app_id);

-- An input is a durably received request. Its context_snapshot is a deep copy
-- of the session config (plus one-off overrides) taken under the session lock.
CREATE TABLE yuxi.inputs (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    seq bigint GENERATED ALWAYS AS IDENTITY,
    session_id uuid NOT NULL,
    tree_id uuid NOT NULL,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    content text NOT NULL,
    mode text NOT NULL,
    status text NOT NULL DEFAULT 'queued',
    client_request_id text,
    context_snapshot jsonb NOT NULL,
    turn_id uuid,
    error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    finished_at timestamptz,
    CONSTRAINT inputs_session_fk FOREIGN KEY (session_id, tree_id, user_id, app_id)
        REFERENCES yuxi.sessions (id, tree_id, user_id, app_id),
    CONSTRAINT inputs_id_session_key UNIQUE (id, session_id),
    CONSTRAINT inputs_client_request_unique UNIQUE (session_id, client_request_id),
    CONSTRAINT inputs_mode_known CHECK (mode IN ('steer', 'queue')),
    CONSTRAINT inputs_status_known CHECK (
        status IN ('queued', 'started', 'completed', 'failed', 'cancelled')),
    CONSTRAINT inputs_finished_iff_terminal CHECK (
        (finished_at IS NOT NULL) = (status IN ('completed', 'failed', 'cancelled'))),
    CONSTRAINT inputs_client_request_not_blank CHECK (
        client_request_id IS NULL OR btrim(client_request_id) <> ''),
    CONSTRAINT inputs_snapshot_is_object CHECK (jsonb_typeof(context_snapshot) = 'object')
);
CREATE INDEX inputs_turn_idx ON yuxi.inputs (turn_id) WHERE turn_id IS NOT NULL;

-- A turn is one round of work started by an input; seq orders the session FIFO.
CREATE TABLE yuxi.turns (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    seq bigint GENERATED ALWAYS AS IDENTITY,
    session_id uuid NOT NULL,
    tree_id uuid NOT NULL,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    input_id uuid NOT NULL,
    status text NOT NULL DEFAULT 'queued',
    result_run_id uuid,
    error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    finished_at timestamptz,
    CONSTRAINT turns_session_fk FOREIGN KEY (session_id, tree_id, user_id, app_id)
        REFERENCES yuxi.sessions (id, tree_id, user_id, app_id),
    CONSTRAINT turns_input_same_session_fk FOREIGN KEY (input_id, session_id)
        REFERENCES yuxi.inputs (id, session_id),
    CONSTRAINT turns_id_owner_key UNIQUE (id, session_id, tree_id, user_id, app_id),
    CONSTRAINT turns_input_unique UNIQUE (input_id),
    CONSTRAINT turns_status_known CHECK (status IN (
        'queued', 'running', 'waiting', 'waiting_user', 'cancelling',
        'cancelled', 'completed', 'failed')),
    CONSTRAINT turns_finished_iff_terminal CHECK (
        (finished_at IS NOT NULL) = (status IN ('completed', 'failed', 'cancelled'))),
    CONSTRAINT turns_completed_has_result CHECK (
        status NOT IN ('completed', 'failed') OR result_run_id IS NOT NULL),
    CONSTRAINT turns_unfinished_has_no_result CHECK (
        status IN ('completed', 'failed', 'cancelled') OR result_run_id IS NULL)
);
-- At most one turn of a session is in flight.
CREATE UNIQUE INDEX turns_one_active_per_session ON yuxi.turns (session_id)
    WHERE status IN ('running', 'waiting', 'waiting_user', 'cancelling');
CREATE INDEX turns_session_seq_idx ON yuxi.turns (session_id, seq);
CREATE INDEX turns_queued_idx ON yuxi.turns (session_id, seq) WHERE status = 'queued';

-- Deferred: an input is written with its turn id, just before its turn's row.
-- (Its turn's whole owner key, so no narrower unique key on turns is needed:
-- every index of a table is written by every non-HOT update of its rows.)
ALTER TABLE yuxi.inputs ADD CONSTRAINT inputs_turn_same_session_fk
    FOREIGN KEY (turn_id, session_id, tree_id, user_id, app_id)
    REFERENCES yuxi.turns (id, session_id, tree_id, user_id, app_id)
    DEFERRABLE INITIALLY DEFERRED;

-- A run is one execution segment of a turn. lease_token fences every write of
-- the worker executing it; slot_seq is its place in the tree's slot FIFO.
CREATE TABLE yuxi.runs (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    slot_seq bigint GENERATED ALWAYS AS IDENTITY,
    turn_id uuid NOT NULL,
    session_id uuid NOT NULL,
    tree_id uuid NOT NULL,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    attempt integer NOT NULL DEFAULT 1,
    -- Runs before this one in its turn's retry chain that a database
    -- connection fault ended (infra_error); attempt - infra_retries is what
    -- crashes and lost leases used up (YUXI_MAX_RUN_ATTEMPTS).
    infra_retries integer NOT NULL DEFAULT 0,
    status text NOT NULL DEFAULT 'pending',
    config jsonb NOT NULL,
    lease_token uuid,
    lease_expires_at timestamptz,
    -- Set (fenced) by the worker whose run met a connection-level error: the
    -- run was cut off by an outage, not failed by its model or a tool.
    infra_error text,
    output jsonb,
    error text,
    -- Token usage of the run's model calls (add_run_usage_v1).
    prompt_tokens bigint NOT NULL DEFAULT 0,
    completion_tokens bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    finished_at timestamptz,
    -- The worker host (YUXI_HOST_ID) that took the lease last.
    host_id text,
    -- The claiming worker process the run was announced to
    -- (defer_run_job_v1) or leased to: the backend pid of its LISTEN
    -- connection (yuxi.claimers_v1). While the run is ready or running it
    -- counts toward that worker's load (pick_claimer_v1, sql/020_slots.sql).
    claimer integer,
    CONSTRAINT runs_turn_fk FOREIGN KEY (turn_id, session_id, tree_id, user_id, app_id)
        REFERENCES yuxi.turns (id, session_id, tree_id, user_id, app_id),
    -- Leading with turn_id, it also serves "a turn's runs".
    CONSTRAINT runs_turn_id_key UNIQUE (turn_id, id),
    CONSTRAINT runs_id_tree_key UNIQUE (id, tree_id),
    CONSTRAINT runs_attempt_positive CHECK (attempt >= 1),
    CONSTRAINT runs_infra_retries_in_attempts CHECK (
        infra_retries >= 0 AND infra_retries < attempt),
    CONSTRAINT runs_status_known CHECK (status IN (
        'pending', 'ready', 'running', 'completed', 'suspended', 'failed', 'cancelled')),
    CONSTRAINT runs_running_has_lease CHECK (
        status <> 'running' OR (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT runs_finished_iff_ended CHECK (
        (finished_at IS NOT NULL) = (status IN ('completed', 'suspended', 'failed', 'cancelled'))),
    CONSTRAINT runs_failed_has_error CHECK (status <> 'failed' OR error IS NOT NULL),
    CONSTRAINT runs_config_is_object CHECK (jsonb_typeof(config) = 'object')
);
-- At most one run of a session holds or awaits a slot.
CREATE UNIQUE INDEX runs_one_live_per_session ON yuxi.runs (session_id)
    WHERE status IN ('pending', 'ready', 'running');
CREATE INDEX runs_pending_fifo_idx ON yuxi.runs (tree_id, slot_seq) WHERE status = 'pending';
CREATE INDEX runs_lease_idx ON yuxi.runs (lease_expires_at) WHERE status = 'running';
CREATE INDEX runs_ready_idx ON yuxi.runs (created_at) WHERE status = 'ready';
CREATE INDEX runs_claimer_idx ON yuxi.runs (claimer) WHERE status IN ('ready', 'running');
ALTER TABLE yuxi.turns ADD CONSTRAINT turns_result_run_same_turn_fk
    FOREIGN KEY (result_run_id, id) REFERENCES yuxi.runs (id, turn_id);

-- A row per run holding one of its tree's slots. The FK ties the claim to a run
-- of the same tree.
CREATE TABLE yuxi.slot_claims (
    run_id uuid PRIMARY KEY,
    tree_id uuid NOT NULL REFERENCES yuxi.trees (id),
    claimed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT slot_claims_run_same_tree_fk FOREIGN KEY (run_id, tree_id)
        REFERENCES yuxi.runs (id, tree_id)
);
CREATE INDEX slot_claims_tree_idx ON yuxi.slot_claims (tree_id);

-- Append-only facts clients observe, gap-free per tree (seq = the tree's last
-- seq + 1, taken under the tree row lock). dedupe_key lets a re-executed step
-- (after a crash) report the same fact once.
CREATE TABLE yuxi.events (
    tree_id uuid NOT NULL,
    seq bigint NOT NULL,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    session_id uuid NOT NULL,
    turn_id uuid,
    run_id uuid,
    type text NOT NULL,
    data jsonb NOT NULL DEFAULT '{}',
    dedupe_key text,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (tree_id, seq),
    CONSTRAINT events_session_fk FOREIGN KEY (session_id, tree_id, user_id, app_id)
        REFERENCES yuxi.sessions (id, tree_id, user_id, app_id),
    CONSTRAINT events_seq_positive CHECK (seq > 0),
    CONSTRAINT events_type_shape CHECK (type ~ '^[a-z_]+(\.[a-z_]+)*$'),
    CONSTRAINT events_data_is_object CHECK (jsonb_typeof(data) = 'object')
);
CREATE UNIQUE INDEX events_dedupe_idx ON yuxi.events (tree_id, dedupe_key)
    WHERE dedupe_key IS NOT NULL;
-- No FK-support index on (session_id, ...): sessions are never deleted, and a
-- session's events are read through the primary key (tree_id, seq); one index
-- less to maintain on the table written most.

-- Who listens for a tree's events (issue 15): a row per tree (yuxi.every_tree_v1():
-- every tree) and listening backend (`pid`, the LISTEN connection's). A
-- transaction that writes events sends `yuxi_events` only when its tree is
-- watched: NOTIFY makes a commit take a cluster-wide lock until it is
-- flushed (PostgreSQL serializes notifying commits to keep the queue in
-- commit order) and wakes every listening backend of the database, so an
-- unwatched tree's writes (most of them: background work, clients on `?wait`)
-- skip both. UNLOGGED: after a server crash every LISTEN connection is gone
-- too, and each listener registers again when it reconnects.
CREATE UNLOGGED TABLE yuxi.event_watches (
    tree_id uuid NOT NULL,
    pid integer NOT NULL,
    since timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tree_id, pid)
);

-- A frozen config is stored again and again (the session's, each input's
-- snapshot, each run's; a fan-out's children three times each). With lz4
-- (when the server was built with it) a 5 KB config compresses ~6x faster
-- than with pglz (~5 vs ~30 us): a 64-child batch ~5 ms sooner.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression'
                                            AND 'lz4' = ANY (enumvals)) THEN
        ALTER TABLE yuxi.agents ALTER COLUMN config SET COMPRESSION lz4;
        ALTER TABLE yuxi.sessions ALTER COLUMN config SET COMPRESSION lz4;
        ALTER TABLE yuxi.inputs ALTER COLUMN context_snapshot SET COMPRESSION lz4;
        ALTER TABLE yuxi.runs ALTER COLUMN config SET COMPRESSION lz4;
    END IF;
END;
$$;
