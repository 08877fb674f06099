-- Receipts whose storage stays flat: four slots, each emptied whole once what it holds is past
-- the retention.
--
-- Up to V4 every receipt was a row of one table, deleted row by row once older than the
-- retention: at 5,000 turns/s a day of receipts is ~430 million rows, each deleted, vacuumed and
-- written to the WAL again, and a pruner that falls behind lets the table grow without bound.
--
-- Now `turnstile_receipt` is partitioned by `slot`, in four partitions. A receipt written at time
-- t goes to slot floor(t / width) mod 4, where `width` is half the retention
-- (`turnstile_receipt_clock`, kept by the service). Once everything in a slot is older than the
-- retention, and it is not the slot being written, the service empties it: detached from the
-- table concurrently (turns neither wait nor are waited for), truncated, attached again
-- (src/store/postgres/receipts.rs). So a receipt is kept for at least the retention and at most
-- about one and a half, and the table holds between one and one and a half retentions' worth.
--
-- Why four slots and not one partition per hour: a lookup by key (every commit checks that its
-- activity has no receipt yet) visits every partition, and each costs the database a few
-- microseconds; a TRUNCATE or DROP of a partition in use would wait for, and then stall, every
-- turn, which the concurrent detach does not.
--
-- Exactly once: no unique index spans partitions, so each slot has its own on `key`, and a
-- receipt's write first looks for the key in every slot (`turnstile_receipt_slots`). Two
-- deliveries of one activity committing at the same moment would not see each other's
-- uncommitted row there; if they are in the same slot, the unique index stops the second. On
-- either side of a slot's start they would write different slots, so a receipt written in the
-- first 10 seconds of a slot (longer than any statement may run: STATEMENT_TIMEOUT, 8 s) is also
-- written in the slot before, where the other's key is.

-- The receipts of the releases before, until they are past the retention: still read, never
-- written, emptied whole once (src/store/postgres/receipts.rs). (Written to run again
-- harmlessly, as the last migration must be: tests/api/schema_health.rs.)
--
-- The 0.1.0 replicas of a rollout reach the table through `public.turnstile_receipt`, a view:
-- their statements lock the view, then the table. So the migration does too, both at once, before
-- it renames the table and replaces the view below; taking the table first deadlocked with them.
DO $$
BEGIN
    IF current_schema() <> 'public' AND EXISTS (
        SELECT 1 FROM pg_views WHERE schemaname = 'public' AND viewname = 'turnstile_receipt')
    THEN
        LOCK TABLE public.turnstile_receipt IN ACCESS EXCLUSIVE MODE;
    END IF;
    IF to_regclass('turnstile_receipt_legacy') IS NULL THEN
        ALTER TABLE turnstile_receipt RENAME TO turnstile_receipt_legacy;
        ALTER INDEX turnstile_receipt_pkey RENAME TO turnstile_receipt_legacy_pkey;
        ALTER INDEX IF EXISTS turnstile_receipt_created_at
            RENAME TO turnstile_receipt_legacy_created_at;
        ALTER INDEX IF EXISTS turnstile_receipt_conversation
            RENAME TO turnstile_receipt_legacy_conversation;
        ALTER INDEX IF EXISTS turnstile_receipt_user RENAME TO turnstile_receipt_legacy_user;
    END IF;
END
$$;

-- How wide a slot is, in seconds: half the retention, set by the service as it starts
-- (`--receipt-retention`). `legacy` says whether `turnstile_receipt_legacy` may still hold a
-- receipt within the retention (cleared once it holds none).
CREATE TABLE IF NOT EXISTS turnstile_receipt_clock (
    one        boolean PRIMARY KEY DEFAULT true CHECK (one),
    width_secs float8  NOT NULL CHECK (width_secs > 0),
    legacy     boolean NOT NULL DEFAULT true
);
INSERT INTO turnstile_receipt_clock (width_secs) VALUES (43200) ON CONFLICT DO NOTHING;

-- The slot of a receipt written at `t`.
CREATE OR REPLACE FUNCTION turnstile_receipt_slot(t timestamptz) RETURNS int2
LANGUAGE sql STABLE SET search_path FROM CURRENT
AS $$
    SELECT (floor(extract(epoch FROM t) / width_secs)::bigint % 4)::int2
      FROM turnstile_receipt_clock
$$;

CREATE TABLE IF NOT EXISTS turnstile_receipt (
    slot       int2        NOT NULL DEFAULT turnstile_receipt_slot(statement_timestamp()),
    key        text        NOT NULL,
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
) PARTITION BY LIST (slot);
CREATE TABLE IF NOT EXISTS turnstile_receipt_0 PARTITION OF turnstile_receipt
    (CONSTRAINT turnstile_receipt_0_pkey PRIMARY KEY (key)) FOR VALUES IN (0);
CREATE TABLE IF NOT EXISTS turnstile_receipt_1 PARTITION OF turnstile_receipt
    (CONSTRAINT turnstile_receipt_1_pkey PRIMARY KEY (key)) FOR VALUES IN (1);
CREATE TABLE IF NOT EXISTS turnstile_receipt_2 PARTITION OF turnstile_receipt
    (CONSTRAINT turnstile_receipt_2_pkey PRIMARY KEY (key)) FOR VALUES IN (2);
CREATE TABLE IF NOT EXISTS turnstile_receipt_3 PARTITION OF turnstile_receipt
    (CONSTRAINT turnstile_receipt_3_pkey PRIMARY KEY (key)) FOR VALUES IN (3);
-- As in V4: a conversation's receipts, a user's; and the newest row of a slot, for emptying it.
CREATE INDEX IF NOT EXISTS turnstile_receipt_conversation
    ON turnstile_receipt (turnstile_key_conversation(key));
CREATE INDEX IF NOT EXISTS turnstile_receipt_user ON turnstile_receipt ((payload->>'user'))
    WHERE payload ? 'user';
CREATE INDEX IF NOT EXISTS turnstile_receipt_created_at
    ON turnstile_receipt USING brin (created_at);

-- The slots a receipt of `p_key` written now goes in: the current one, and in a slot's first
-- 10 seconds (a quarter of a slot, if that is less: slots that narrow are for tests) the one
-- before too. When the key has a receipt already, in any slot (or in the legacy table while it
-- may hold one): none if `p_if_absent`, else a unique violation named `turnstile_receipt_pkey`,
-- as the single table of the releases before raised it, so that their replicas and this one read
-- it alike: the activity committed already. Statements insert `unnest(…)` of it.
--
-- A scalar PL/pgSQL function with one query: as a set-returning function in FROM it cost the
-- database a third more per commit (its rows go through a tuplestore, and the statement around
-- it was planned again at every execution), and as plain SQL in the statement more still.
DROP FUNCTION IF EXISTS turnstile_receipt_slots(text, boolean);
CREATE FUNCTION turnstile_receipt_slots(p_key text, p_if_absent boolean DEFAULT false)
RETURNS int2[]
LANGUAGE plpgsql STRICT AS $$
DECLARE
    taken boolean;
    width float8;
    now_epoch float8 := extract(epoch FROM statement_timestamp());
    slot int2;
    before int2;
BEGIN
    SELECT EXISTS (SELECT 1 FROM turnstile_receipt WHERE key = p_key)
           OR (c.legacy AND EXISTS (SELECT 1 FROM turnstile_receipt_legacy WHERE key = p_key)),
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

-- V4's key functions, no longer STRICT: PostgreSQL inlines a SQL function into the expression
-- that calls it only if it is not STRICT or its body is strict too, and a CASE is not. Called
-- instead, each evaluation planned the function's query again: about 170,000 instructions for
-- every receipt written (the conversation's index on it), a third of the commit's cost. The
-- results are the same (NULL for NULL).
CREATE OR REPLACE FUNCTION turnstile_key_conversation(p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN split_part(p_key, '/', 3) = 'conversations'
                THEN split_part(p_key, '/', 2) || '/' || split_part(p_key, '/', 4) END
$$;

CREATE OR REPLACE FUNCTION turnstile_key_user(p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN split_part(p_key, '/', 3) = 'users' AND split_part(p_key, '/', 5) = ''
            THEN split_part(p_key, '/', 2) || '/' || split_part(p_key, '/', 4)
        WHEN split_part(p_key, '/', 3) = 'conversations' AND split_part(p_key, '/', 5) = 'users'
             AND split_part(p_key, '/', 7) = ''
            THEN split_part(p_key, '/', 2) || '/' || split_part(p_key, '/', 6)
    END
$$;

-- turnstile_commit as in V4, its receipt written through turnstile_receipt_slots. With the
-- migration's search_path, set here rather than after the migrations (src/store/postgres/layout.rs
-- sets it again): a 0.1.0 replica calls it through `public`, with `public` first on its path,
-- where `turnstile_receipt` is its view, and it must not find that in the moment between.
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
            PERFORM 1 FROM turnstile_state WHERE key = k;
            IF FOUND THEN
                conflict_key := k;
                RETURN;
            END IF;
        ELSE
            SELECT version INTO seen FROM turnstile_state WHERE key = k FOR SHARE;
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
        IF expected < 0 THEN
            INSERT INTO turnstile_state (key, state, version)
            SELECT k, new_state, -expected
             WHERE coalesce((SELECT t.version FROM turnstile_tombstone t
                              WHERE t.key_hash = turnstile_key_hash(k)), 0) = -expected - 1
            ON CONFLICT (key) DO NOTHING
            RETURNING version INTO seen;
        ELSIF expected = 0 THEN
            INSERT INTO turnstile_state (key, state, version)
            VALUES (k, new_state, 1)
            ON CONFLICT (key) DO NOTHING
            RETURNING version INTO seen;
        ELSE
            UPDATE turnstile_state
               SET state = new_state, version = version + 1, updated_at = now()
             WHERE key = k AND version = expected
            RETURNING version INTO seen;
        END IF;
        IF NOT FOUND THEN
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

    IF p_receipt_key IS NOT NULL THEN
        INSERT INTO turnstile_receipt (slot, key, payload)
        SELECT unnest(turnstile_receipt_slots(p_receipt_key, true)), p_receipt_key, p_receipt;
        IF NOT FOUND THEN
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
    END IF;
END
$$;

-- The replicas of 0.1.0 during a rolling upgrade (src/store/postgres/layout.rs) read and write
-- `public.turnstile_receipt`: they must see this release's receipts, and theirs must land where
-- this release looks, checked the same way. Their view now shows both tables, and an insert
-- through it goes through turnstile_receipt_slots.
DO $$
DECLARE
    here text := current_schema();
BEGIN
    IF here <> 'public' AND EXISTS (
        SELECT 1 FROM pg_views WHERE schemaname = 'public' AND viewname = 'turnstile_receipt')
    THEN
        DROP VIEW public.turnstile_receipt;
        EXECUTE format(
            'CREATE VIEW public.turnstile_receipt AS
               SELECT key, payload, created_at FROM %1$I.turnstile_receipt
               UNION ALL
               SELECT key, payload, created_at FROM %1$I.turnstile_receipt_legacy', here);
        EXECUTE format(
            'CREATE OR REPLACE FUNCTION %1$I.turnstile_receipt_compat_insert() RETURNS trigger
             LANGUAGE plpgsql SET search_path = %1$I, public AS $f$
             BEGIN
                 INSERT INTO turnstile_receipt (slot, key, payload)
                 SELECT unnest(turnstile_receipt_slots(NEW.key)), NEW.key, NEW.payload;
                 RETURN NEW;
             END
             $f$', here);
        EXECUTE format(
            'CREATE TRIGGER turnstile_receipt_compat_insert INSTEAD OF INSERT
                 ON public.turnstile_receipt
                 FOR EACH ROW EXECUTE FUNCTION %I.turnstile_receipt_compat_insert()', here);
    END IF;
END
$$;
