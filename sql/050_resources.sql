-- Resources and grants. Agents and sessions store only a selection *intent*
-- (resource names, or "all"): visibility is resolved from the grants current
-- when a run starts, and side-effecting tools check their grant again when
-- they execute. Errors: YX006 permission denied.

-- A named resource of an app: a knowledge collection or a tool group.
CREATE TABLE yuxi.resources (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    app_id uuid NOT NULL REFERENCES yuxi.apps (id),
    kind text NOT NULL,
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT resources_kind_known CHECK (kind IN ('collection', 'tool_group')),
    CONSTRAINT resources_name_valid CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'),
    CONSTRAINT resources_unique_in_app UNIQUE (app_id, kind, name),
    CONSTRAINT resources_id_app_key UNIQUE (id, app_id)
);

-- A grant of a resource to a user of its app; revoking keeps the row.
CREATE TABLE yuxi.grants (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    resource_id uuid NOT NULL,
    user_id uuid NOT NULL REFERENCES yuxi.users (id),
    app_id uuid NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    CONSTRAINT grants_resource_same_app_fk FOREIGN KEY (resource_id, app_id)
        REFERENCES yuxi.resources (id, app_id),
    CONSTRAINT grants_revoked_after_granted CHECK (revoked_at IS NULL OR revoked_at >= granted_at)
);
CREATE UNIQUE INDEX grants_one_live_idx ON yuxi.grants (resource_id, user_id)
    WHERE revoked_at IS NULL;
CREATE INDEX grants_user_app_idx ON yuxi.grants (user_id, app_id) WHERE revoked_at IS NULL;

-- Notes written into a collection by the `add_note` tool. (session, call_id)
-- makes a re-executed tool call write once.
CREATE TABLE yuxi.notes (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    resource_id uuid NOT NULL,
    user_id uuid NOT NULL,
    app_id uuid NOT NULL,
    session_id uuid NOT NULL,
    tree_id uuid NOT NULL,
    run_id uuid NOT NULL REFERENCES yuxi.runs (id),
    call_id text NOT NULL,
    content text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT notes_resource_same_app_fk FOREIGN KEY (resource_id, app_id)
        REFERENCES yuxi.resources (id, app_id),
    CONSTRAINT notes_session_fk FOREIGN KEY (session_id, tree_id, user_id, app_id)
        REFERENCES yuxi.sessions (id, tree_id, user_id, app_id),
    CONSTRAINT notes_call_once UNIQUE (session_id, call_id)
);
CREATE INDEX notes_resource_idx ON yuxi.notes (resource_id, app_id);

-- Create (or find) a resource of an app.
CREATE FUNCTION yuxi.ensure_resource_v1(p_app uuid, p_kind text, p_name text) RETURNS uuid
    LANGUAGE sql AS $$
    INSERT INTO yuxi.resources (app_id, kind, name) VALUES (p_app, p_kind, p_name)
    ON CONFLICT (app_id, kind, name) DO UPDATE SET name = EXCLUDED.name
    RETURNING id;
$$;

-- Grant a resource to a user (idempotent while the grant is live).
CREATE FUNCTION yuxi.grant_v1(p_user uuid, p_app uuid, p_kind text, p_name text) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_resource uuid;
    v_grant uuid;
BEGIN
    SELECT id INTO v_resource FROM yuxi.resources
     WHERE app_id = p_app AND kind = p_kind AND name = p_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no resource %:% in this app', p_kind, p_name USING ERRCODE = 'YX002';
    END IF;
    INSERT INTO yuxi.grants (resource_id, user_id, app_id) VALUES (v_resource, p_user, p_app)
    ON CONFLICT (resource_id, user_id) WHERE revoked_at IS NULL DO NOTHING
    RETURNING id INTO v_grant;
    RETURN coalesce(v_grant, (SELECT id FROM yuxi.grants WHERE resource_id = v_resource
                               AND user_id = p_user AND revoked_at IS NULL));
END;
$$;

-- Revoke a user's live grant of a resource. Returns whether one was revoked.
CREATE FUNCTION yuxi.revoke_v1(p_user uuid, p_app uuid, p_kind text, p_name text) RETURNS boolean
    LANGUAGE sql AS $$
    WITH revoked AS (
        UPDATE yuxi.grants g SET revoked_at = now()
          FROM yuxi.resources r
         WHERE r.id = g.resource_id AND r.app_id = p_app AND r.kind = p_kind
           AND r.name = p_name AND g.user_id = p_user AND g.revoked_at IS NULL
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM revoked);
$$;

-- Resolve a selection intent with the grants current now: `"all"` gives every
-- granted resource of the app; a list of "kind:name" gives each of them with
-- whether the user holds a live grant.
CREATE FUNCTION yuxi.resolve_resources_v1(p_user uuid, p_app uuid, p_selection jsonb)
RETURNS TABLE (kind text, name text, resource_id uuid, granted boolean)
    LANGUAGE sql STABLE AS $$
    WITH wanted AS (
        SELECT split_part(v, ':', 1) AS kind, substr(v, strpos(v, ':') + 1) AS name
          FROM jsonb_array_elements_text(
                   CASE WHEN jsonb_typeof(p_selection) = 'array' THEN p_selection
                        ELSE '[]' END) AS v
    ),
    live AS (
        SELECT r.kind, r.name, r.id
          FROM yuxi.resources r
          JOIN yuxi.grants g ON g.resource_id = r.id AND g.app_id = r.app_id
         WHERE r.app_id = p_app AND g.user_id = p_user AND g.revoked_at IS NULL
    )
    SELECT w.kind, w.name, l.id, l.id IS NOT NULL
      FROM wanted w LEFT JOIN live l ON l.kind = w.kind AND l.name = w.name
     WHERE jsonb_typeof(p_selection) = 'array'
    UNION ALL
    SELECT l.kind, l.name, l.id, true FROM live l
     WHERE p_selection = '"all"'::jsonb;
$$;

-- The grant check of a side-effecting tool, at the moment it executes: the
-- resource id, or YX006 when the user holds no live grant.
CREATE FUNCTION yuxi.check_grant_v1(p_user uuid, p_app uuid, p_kind text, p_name text)
RETURNS uuid
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_resource uuid;
BEGIN
    SELECT r.id INTO v_resource
      FROM yuxi.resources r
      JOIN yuxi.grants g ON g.resource_id = r.id AND g.app_id = r.app_id
     WHERE r.app_id = p_app AND r.kind = p_kind AND r.name = p_name
       AND g.user_id = p_user AND g.revoked_at IS NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'permission denied: no grant for %:%', p_kind, p_name
            USING ERRCODE = 'YX006';
    END IF;
    RETURN v_resource;
END;
$$;

-- The `add_note` tool's effect: fenced by the run's lease, checked against
-- the grants current now (tool group `notes` and the collection), written
-- once per (session, tool call). Returns the note id.
CREATE FUNCTION yuxi.add_note_v1(
    p_run uuid, p_token uuid, p_call_id text, p_collection text, p_content text
) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    v_run yuxi.runs;
    v_resource uuid;
    v_note uuid;
BEGIN
    PERFORM yuxi.check_lease_v1(p_run, p_token);
    SELECT * INTO v_run FROM yuxi.runs WHERE id = p_run;
    PERFORM yuxi.check_grant_v1(v_run.user_id, v_run.app_id, 'tool_group', 'notes');
    v_resource := yuxi.check_grant_v1(v_run.user_id, v_run.app_id, 'collection', p_collection);
    INSERT INTO yuxi.notes (resource_id, user_id, app_id, session_id, tree_id, run_id,
                            call_id, content)
    VALUES (v_resource, v_run.user_id, v_run.app_id, v_run.session_id, v_run.tree_id, p_run,
            p_call_id, p_content)
    ON CONFLICT (session_id, call_id) DO NOTHING
    RETURNING id INTO v_note;
    RETURN coalesce(v_note, (SELECT id FROM yuxi.notes
                             WHERE session_id = v_run.session_id AND call_id = p_call_id));
END;
$$;
