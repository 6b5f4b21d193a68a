-- Tree-locality probe (tests only; docs/scale-out.md): statement-level
-- triggers on every tree-scoped table record any single statement whose
-- written rows (new or old) belong to more than one tree. Under Citus, with
-- tree_id as the distribution column, such a statement would be a
-- multi-shard write; a hot path must never make one.

CREATE SCHEMA yuxi_probe;

CREATE TABLE yuxi_probe.cross_tree (
    table_name text NOT NULL,
    operation text NOT NULL,
    trees integer NOT NULL,
    query text NOT NULL
);

CREATE FUNCTION yuxi_probe.check_rows() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    v_column text := TG_ARGV[0];
    v_trees integer;
BEGIN
    IF TG_OP = 'DELETE' THEN
        EXECUTE format('SELECT count(DISTINCT %I) FROM old_rows', v_column) INTO v_trees;
    ELSE
        EXECUTE format('SELECT count(DISTINCT %I) FROM new_rows', v_column) INTO v_trees;
    END IF;
    IF v_trees > 1 THEN
        INSERT INTO yuxi_probe.cross_tree VALUES (TG_TABLE_NAME, TG_OP, v_trees, current_query());
    END IF;
    RETURN NULL;
END;
$$;

DO $$
DECLARE
    v_table text;
    v_column text;
BEGIN
    FOR v_table, v_column IN VALUES
        ('trees', 'id'), ('sessions', 'tree_id'), ('inputs', 'tree_id'), ('turns', 'tree_id'),
        ('runs', 'tree_id'), ('slot_claims', 'tree_id'), ('events', 'tree_id'),
        ('effects', 'tree_id'), ('waits', 'tree_id'), ('messages', 'receiver_tree_id'),
        ('sandboxes', 'tree_id'), ('sandbox_processes', 'tree_id'), ('notes', 'tree_id')
    LOOP
        EXECUTE format('CREATE TRIGGER probe_insert AFTER INSERT ON yuxi.%I '
                       'REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT '
                       'EXECUTE FUNCTION yuxi_probe.check_rows(%L)', v_table, v_column);
        EXECUTE format('CREATE TRIGGER probe_update AFTER UPDATE ON yuxi.%I '
                       'REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT '
                       'EXECUTE FUNCTION yuxi_probe.check_rows(%L)', v_table, v_column);
        EXECUTE format('CREATE TRIGGER probe_delete AFTER DELETE ON yuxi.%I '
                       'REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT '
                       'EXECUTE FUNCTION yuxi_probe.check_rows(%L)', v_table, v_column);
    END LOOP;
END;
$$;
