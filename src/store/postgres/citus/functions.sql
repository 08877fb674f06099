-- Turnstile's functions as a Citus cluster runs them (src/store/postgres/citus.rs), installed by
-- `turnstile migrate` after the migrations, every time, so that a migration that replaces one of
-- them with its single-node body is followed at once by this one.
--
-- The differences from the single-node bodies (migrations/V5__receipt_slots.sql), and why:
-- - Every statement names its row by the shard column too, `shard = turnstile_key_shard(k)`, so
--   that Citus routes it to the one shard that holds the key, instead of asking all of them (and
--   refusing the FOR SHARE of a statement that spans shards).
-- - Rows are inserted with `INSERT … VALUES`, one row at a time. Citus runs an `INSERT … SELECT`
--   through the coordinator and commits it with two-phase commit, even when every row lands on
--   one shard; a conversation's turn then paid a PREPARE TRANSACTION on every commit.
-- - A create reads its key's tombstone (a reference table, local wherever it runs) into a
--   variable first, for the same reason.

CREATE OR REPLACE FUNCTION turnstile_key_shard(p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT coalesce(substring(p_key FROM '^[^/]*/[^/]*/[^/]*/[^/]*'), p_key) $$;

-- The shards of keys `p_keys`, each once: `shard = ANY(turnstile_key_shards($1))` asks only those.
-- (turnstile_key_shard's expression written out: a worker that runs a statement naming this
-- function finds no other function of Turnstile's schema on its path.)
CREATE OR REPLACE FUNCTION turnstile_key_shards(p_keys text[]) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT array_agg(DISTINCT coalesce(substring(k FROM '^[^/]*/[^/]*/[^/]*/[^/]*'), k))
      FROM unnest(p_keys) AS k
$$;

-- The load of a turn holding its conversation's lock (src/store/postgres.rs, LOAD_HOLDING): the
-- state rows of `p_keys` with their ages, conversation `p_held`'s row locked until the
-- transaction ends, the tombstones of the keys without rows, and receipt `p_receipt`. (A turn
-- without the lock loads shard by shard: src/store/postgres/citus.rs, LOAD_SHARD.) Each part is a
-- query of its own, as Citus cannot lock a row in a statement over several shards. The parts are
-- not one snapshot, and need not be: the commit checks every key the turn read against the
-- version it saw. A tombstone under a row is ignored, so only keys the rows' parts did not find
-- are looked up, and their hash is written out as turnstile_key_hash computes it (a call of that
-- SQL function is planned again at every execution).
CREATE OR REPLACE FUNCTION turnstile_load(p_keys text[], p_receipt text, p_held text)
RETURNS TABLE (kind int2, key text, state jsonb, version bigint, age float8)
LANGUAGE plpgsql AS $$
DECLARE
    found text[] := '{}';
BEGIN
    FOR kind, key, state, version, age IN
        SELECT 0::int2, s.key, s.state, s.version,
               extract(epoch FROM now() - s.updated_at)::float8
          FROM turnstile_state s
         WHERE s.shard = turnstile_key_shard(p_held) AND s.key = p_held
           FOR UPDATE
    LOOP
        found := found || key;
        RETURN NEXT;
    END LOOP;
    FOR kind, key, state, version, age IN
        SELECT 0::int2, s.key, s.state, s.version,
               extract(epoch FROM now() - s.updated_at)::float8
          FROM turnstile_state s
         WHERE s.shard = ANY(turnstile_key_shards(p_keys)) AND s.key = ANY(p_keys)
           AND s.key <> p_held
    LOOP
        found := found || key;
        RETURN NEXT;
    END LOOP;
    RETURN QUERY
    SELECT 2::int2, k, NULL::jsonb, t.version, NULL::float8 FROM unnest(p_keys) AS k
      JOIN turnstile_tombstone t ON t.key_hash = sha256(convert_to(k, 'UTF8'))
     WHERE k <> ALL(found);
    IF p_receipt IS NOT NULL THEN
        RETURN QUERY
        SELECT 1::int2, r.key, r.payload, 0::bigint, NULL::float8 FROM (
          SELECT x.key, x.payload FROM turnstile_receipt x
           WHERE x.shard = turnstile_key_shard(p_receipt) AND x.key = p_receipt
          UNION ALL
          SELECT x.key, x.payload FROM turnstile_receipt_legacy x
           WHERE x.shard = turnstile_key_shard(p_receipt) AND x.key = p_receipt LIMIT 1) r;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION turnstile_receipt_slots(p_key text, p_if_absent boolean DEFAULT false)
RETURNS int2[]
LANGUAGE plpgsql STRICT AS $$
DECLARE
    taken boolean;
    width float8;
    now_epoch float8 := extract(epoch FROM statement_timestamp());
    slot int2;
    before int2;
BEGIN
    SELECT EXISTS (SELECT 1 FROM turnstile_receipt
                    WHERE shard = turnstile_key_shard(p_key) AND key = p_key)
           OR (c.legacy AND EXISTS (SELECT 1 FROM turnstile_receipt_legacy
                                     WHERE shard = turnstile_key_shard(p_key) AND key = p_key)),
           c.width_secs
      INTO taken, width FROM turnstile_receipt_clock c;
    IF taken THEN
        IF p_if_absent THEN
            RETURN '{}';
        END IF;
        RAISE unique_violation USING
            CONSTRAINT = 'turnstile_receipt_pkey',
            MESSAGE = 'turnstile receipt exists: the activity committed already',
            DETAIL = p_key;
    END IF;
    slot := (floor(now_epoch / width)::bigint % 4)::int2;
    before := (floor((now_epoch - least(10, width / 4)) / width)::bigint % 4)::int2;
    IF before = slot THEN
        RETURN ARRAY[slot];
    END IF;
    RETURN ARRAY[slot, before];
END
$$;

-- Writes receipt `p_key` in the slots `turnstile_receipt_slots` names, one router-planned insert
-- each; returns how many (0: the activity has a receipt already). A receipt that appears
-- meanwhile (the same activity committing on another replica) is skipped, not raised: Citus
-- passes a worker's unique violation on without the name of its constraint, by which the store
-- tells a receipt that exists from other failures. One found in some of its slots but not all is
-- that same race, raised as a conflict that undoes the commit.
CREATE OR REPLACE FUNCTION turnstile_receipt_write(p_key text, p_payload jsonb, p_if_absent boolean)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    slots int2[] := turnstile_receipt_slots(p_key, p_if_absent);
    s int2;
    written integer := 0;
BEGIN
    -- Into the slot's own table: the parent has no unique index for ON CONFLICT to name.
    FOREACH s IN ARRAY slots LOOP
        CASE s
        WHEN 0 THEN
            INSERT INTO turnstile_receipt_0 (shard, slot, key, payload)
            VALUES (turnstile_key_shard(p_key), s, p_key, p_payload)
            ON CONFLICT (shard, key) DO NOTHING;
        WHEN 1 THEN
            INSERT INTO turnstile_receipt_1 (shard, slot, key, payload)
            VALUES (turnstile_key_shard(p_key), s, p_key, p_payload)
            ON CONFLICT (shard, key) DO NOTHING;
        WHEN 2 THEN
            INSERT INTO turnstile_receipt_2 (shard, slot, key, payload)
            VALUES (turnstile_key_shard(p_key), s, p_key, p_payload)
            ON CONFLICT (shard, key) DO NOTHING;
        ELSE
            INSERT INTO turnstile_receipt_3 (shard, slot, key, payload)
            VALUES (turnstile_key_shard(p_key), s, p_key, p_payload)
            ON CONFLICT (shard, key) DO NOTHING;
        END CASE;
        IF FOUND THEN
            written := written + 1;
        END IF;
    END LOOP;
    IF written > 0 AND written < cardinality(slots) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'TS409',
            MESSAGE = 'turnstile commit conflict: the same activity committed meanwhile',
            DETAIL = p_key;
    END IF;
    RETURN written;
END
$$;

CREATE OR REPLACE FUNCTION turnstile_commit(
    p_keys text[],
    p_expected bigint[],
    p_states jsonb[],
    p_receipt_key text,
    p_receipt jsonb,
    OUT conflict_key text,
    OUT versions bigint[]
)
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    n integer := coalesce(array_length(p_keys, 1), 0);
    seen bigint;
    gone bigint;
    wrote boolean := false;
    k text;
    expected bigint;
    new_state jsonb;
BEGIN
    FOR i IN 1 .. n LOOP
        CONTINUE WHEN p_states[i] IS NOT NULL;
        k := p_keys[i];
        expected := p_expected[i];
        IF expected <= 0 THEN
            PERFORM 1 FROM turnstile_state WHERE shard = turnstile_key_shard(k) AND key = k;
            IF FOUND THEN
                conflict_key := k;
                RETURN;
            END IF;
        ELSE
            SELECT version INTO seen FROM turnstile_state
             WHERE shard = turnstile_key_shard(k) AND key = k FOR SHARE;
            IF NOT FOUND OR seen <> expected THEN
                conflict_key := k;
                RETURN;
            END IF;
        END IF;
    END LOOP;

    versions := '{}';
    FOR i IN 1 .. n LOOP
        k := p_keys[i];
        expected := p_expected[i];
        new_state := p_states[i];
        IF new_state IS NULL THEN
            versions := versions || greatest(expected, 0);
            CONTINUE;
        END IF;
        seen := NULL;
        IF expected <= 0 THEN
            -- 0 (a release before 0.2) creates at 1 and only over no tombstone; -n creates at n
            -- over the tombstone of n - 1 (migrations/V4__erasure.sql).
            SELECT t.version INTO gone FROM turnstile_tombstone t
             WHERE t.key_hash = turnstile_key_hash(k);
            IF coalesce(gone, 0) = greatest(-expected, 1) - 1 THEN
                INSERT INTO turnstile_state (shard, key, state, version)
                VALUES (turnstile_key_shard(k), k, new_state, greatest(-expected, 1))
                ON CONFLICT (shard, key) DO NOTHING
                RETURNING version INTO seen;
            END IF;
        ELSE
            UPDATE turnstile_state
               SET state = new_state, version = version + 1, updated_at = now()
             WHERE shard = turnstile_key_shard(k) AND key = k AND version = expected
            RETURNING version INTO seen;
        END IF;
        IF seen IS NULL THEN
            IF NOT wrote THEN
                conflict_key := k;
                versions := NULL;
                RETURN;
            END IF;
            RAISE EXCEPTION USING
                ERRCODE = 'TS409',
                MESSAGE = 'turnstile commit conflict: a key moved after another was written',
                DETAIL = k;
        END IF;
        wrote := true;
        versions := versions || seen;
    END LOOP;

    IF p_receipt_key IS NOT NULL AND turnstile_receipt_write(p_receipt_key, p_receipt, true) = 0
    THEN
        IF NOT wrote THEN
            conflict_key := p_receipt_key;
            versions := NULL;
            RETURN;
        END IF;
        RAISE EXCEPTION USING
            ERRCODE = 'TS409',
            MESSAGE = 'turnstile commit conflict: the same activity committed meanwhile',
            DETAIL = p_receipt_key;
    END IF;
END
$$;

-- A conversation's fenced hold taken (src/store/postgres/hold.rs, TAKE), as Citus can run it:
-- Citus refuses the single statement's subqueries in an INSERT's VALUES and ON CONFLICT, and a
-- volatile clock in a distributed UPDATE. So the row is created if absent, else locked and read,
-- and the decision made here, with the same rules: taken when released or run out and no waiter
-- who still asks is ahead of ticket `p_ticket` in the line; what the turns before handed on is
-- kept, and the line loses the ticket and the waiters who stopped asking. Answers the fence and
-- what was handed on (the pending activities without a receipt yet), or, not taken, the activity
-- its holder runs.
CREATE OR REPLACE FUNCTION turnstile_hold_take(
    p_key text, p_holder text, p_for float8, p_activity text, p_still float8, p_ticket text)
RETURNS TABLE (fence bigint, running text, superseded jsonb, pending jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    now_epoch float8 := extract(epoch FROM clock_timestamp());
    fresh jsonb := jsonb_build_object('holder', p_holder, 'activity', p_activity,
                                      'until', now_epoch + p_for);
    gone bigint;
    cur jsonb;
    v bigint;
    line jsonb;
    mine bigint;
    entry jsonb;
    waiting jsonb;
BEGIN
    SELECT t.version INTO gone FROM turnstile_tombstone t
     WHERE t.key_hash = turnstile_key_hash(p_key);
    INSERT INTO turnstile_state (shard, key, state, version)
    VALUES (turnstile_key_shard(p_key), p_key, fresh, coalesce(gone, 0) + 1)
    ON CONFLICT (shard, key) DO NOTHING
    RETURNING turnstile_state.version INTO v;
    IF v IS NOT NULL THEN
        RETURN QUERY SELECT v, NULL::text, NULL::jsonb, NULL::jsonb;
        RETURN;
    END IF;
    SELECT s.state, s.version INTO cur, v FROM turnstile_state s
     WHERE s.shard = turnstile_key_shard(p_key) AND s.key = p_key FOR UPDATE;
    IF NOT FOUND THEN
        -- Deleted since the insert found it: asked again, it is created.
        RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::jsonb, NULL::jsonb;
        RETURN;
    END IF;
    line := coalesce(cur->'queue', '[]');
    SELECT m.n INTO mine FROM jsonb_array_elements(line) WITH ORDINALITY AS m(e, n)
     WHERE m.e->>'ticket' = p_ticket LIMIT 1;
    IF (cur->>'until')::float8 > now_epoch OR EXISTS (
        SELECT 1 FROM jsonb_array_elements(line) WITH ORDINALITY AS q(e, n)
         WHERE q.e->>'ticket' <> p_ticket AND (q.e->>'seen')::float8 > now_epoch - p_still
           AND q.n < coalesce(mine, 9223372036854775807))
    THEN
        RETURN QUERY SELECT NULL::bigint, cur->>'activity', NULL::jsonb, NULL::jsonb;
        RETURN;
    END IF;
    fresh := fresh || jsonb_build_object(
        'superseded', coalesce(cur->'superseded', '[]'),
        'pending', coalesce(cur->'pending', '[]'),
        'queue', coalesce((SELECT jsonb_agg(q.e ORDER BY q.n)
                             FROM jsonb_array_elements(line) WITH ORDINALITY AS q(e, n)
                            WHERE q.e->>'ticket' <> p_ticket
                              AND (q.e->>'seen')::float8 > now_epoch - p_still), '[]'));
    UPDATE turnstile_state SET state = fresh, version = v + 1, updated_at = now()
     WHERE shard = turnstile_key_shard(p_key) AND key = p_key;
    -- The pending activities not answered meanwhile, each receipt asked of its shard.
    FOR entry IN SELECT p.entry FROM jsonb_array_elements(fresh->'pending')
                                     WITH ORDINALITY AS p(entry, n) ORDER BY p.n LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM turnstile_receipt r
                               WHERE r.shard = turnstile_key_shard(entry->>'receipt')
                                 AND r.key = entry->>'receipt');
        waiting := coalesce(waiting, '[]') || jsonb_build_array(entry);
    END LOOP;
    RETURN QUERY SELECT v + 1, NULL::text, fresh->'superseded', waiting;
END
$$;

-- An activity added to the list of hold `p_key` waiting to be answered together (hold.rs,
-- ADD_PENDING), unless it is there (receipt key `p_receipt`): the row created if absent, above
-- its tombstone, as the single statement does with subqueries Citus refuses in an INSERT.
CREATE OR REPLACE FUNCTION turnstile_hold_add_pending(p_key text, p_entry jsonb, p_receipt text)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    gone bigint;
BEGIN
    SELECT t.version INTO gone FROM turnstile_tombstone t
     WHERE t.key_hash = turnstile_key_hash(p_key);
    INSERT INTO turnstile_state (shard, key, state, version)
    VALUES (turnstile_key_shard(p_key), p_key,
            jsonb_build_object('until', 0, 'pending', jsonb_build_array(p_entry)),
            coalesce(gone, 0) + 1)
    ON CONFLICT (shard, key) DO NOTHING;
    IF NOT FOUND THEN
        UPDATE turnstile_state
           SET state = jsonb_set(state, '{pending}',
                                 coalesce(state->'pending', '[]') || jsonb_build_array(p_entry))
         WHERE shard = turnstile_key_shard(p_key) AND key = p_key
           AND NOT coalesce(state->'pending', '[]')
                   @> jsonb_build_array(jsonb_build_object('receipt', p_receipt));
    END IF;
END
$$;

-- A commit whose keys and receipt are all on shard `p_shard` (src/store/postgres/citus.rs,
-- COMMIT_IN): `turnstile_commit`, its answer as JSON (`conflict`, `versions`). Distributed by
-- `p_shard` (citus.rs), so that Citus sends the whole call to the worker that holds the shard, to
-- run there next to its rows: one round trip from the coordinator instead of one per statement.
-- Called inside a transaction (a turn holding its conversation lock), it runs on the coordinator
-- like any function.
CREATE OR REPLACE FUNCTION turnstile_commit_in(
    p_shard text, p_keys text[], p_expected bigint[], p_states jsonb[], p_receipt_key text,
    p_receipt jsonb)
RETURNS jsonb
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    outcome record;
BEGIN
    SELECT * INTO outcome
      FROM turnstile_commit(p_keys, p_expected, p_states, p_receipt_key, p_receipt);
    RETURN jsonb_build_object('conflict', outcome.conflict_key, 'versions', outcome.versions);
END
$$;

-- The group commit's statement on Citus (src/store/postgres/group_commit.rs): the single-scope
-- commits of many turns, write `i` of key `p_keys[i]` over version `p_expected[i]` with receipt
-- `p_receipt_keys[i]`, each by `turnstile_commit`, in one transaction. Answers each write's new
-- version, NULL where its key moved (that turn alone is a conflict, nothing of it written).
-- Distributed by `p_shard`, a shard of one of the writes, like `turnstile_commit_in`: the
-- committer sends together the writes whose shards live on one node, so Citus runs the whole
-- call there and every statement in it on a shard of that node, in one local transaction. A
-- write whose shard is elsewhere (moved since the committer looked) still commits with the
-- others, Citus then committing in two phases from the node.
CREATE OR REPLACE FUNCTION turnstile_commit_many_in(
    p_shard text, p_keys text[], p_states jsonb[], p_expected bigint[], p_receipt_keys text[],
    p_receipts jsonb[])
RETURNS bigint[]
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    outcome record;
    versions bigint[] := '{}';
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_keys, 1), 0) LOOP
        SELECT * INTO outcome
          FROM turnstile_commit(ARRAY[p_keys[i]], ARRAY[p_expected[i]], ARRAY[p_states[i]],
                                p_receipt_keys[i], p_receipts[i]);
        versions := versions || outcome.versions[1];
    END LOOP;
    RETURN versions;
END
$$;

-- `turnstile_commit`, and if it applied, the receipts `p_also_keys` (payloads `p_also`) of the
-- other activities the run answered, each kept if it exists (src/store/postgres.rs,
-- COMMIT_WITH_RECEIPTS): one transaction, all or none.
CREATE OR REPLACE FUNCTION turnstile_commit_also(
    p_keys text[],
    p_expected bigint[],
    p_states jsonb[],
    p_receipt_key text,
    p_receipt jsonb,
    p_also_keys text[],
    p_also jsonb[],
    OUT conflict_key text,
    OUT versions bigint[]
)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT c.conflict_key, c.versions INTO conflict_key, versions
      FROM turnstile_commit(p_keys, p_expected, p_states, p_receipt_key, p_receipt) c;
    IF conflict_key IS NULL THEN
        FOR i IN 1 .. coalesce(array_length(p_also_keys, 1), 0) LOOP
            PERFORM turnstile_receipt_write(p_also_keys[i], p_also[i], true);
        END LOOP;
    END IF;
END
$$;
