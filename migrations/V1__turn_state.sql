-- One row per state key (one scope of one conversation or user of one bot). `version` is the
-- row's ETag: 1 when created, one more at every change.
CREATE TABLE turnstile_state (
    key        text        PRIMARY KEY,
    state      jsonb       NOT NULL,
    version    bigint      NOT NULL CHECK (version > 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- What a committed turn answered, kept so that a redelivered activity gets the same answer
-- without running the bot again. `payload` is opaque to the database (the service's JSON).
-- Pruned by age in the background.
CREATE TABLE turnstile_receipt (
    key        text        PRIMARY KEY,
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX turnstile_receipt_created_at ON turnstile_receipt (created_at);

-- Applies one turn's commit in a single round trip, all keys or none.
--
-- For each key i (the caller sorts keys, so every commit locks in one order and two commits
-- cannot deadlock): p_expected[i] is the version the turn saw, 0 for "did not exist";
-- p_states[i] is the new state, NULL for a key the turn only read.
--
-- Phase 1 checks every expectation, locking the rows that exist (FOR UPDATE when they are about
-- to be written, FOR SHARE when only read), so nothing checked can change before phase 2. A
-- failed check is the ordinary outcome "conflict": it returns the key and writes nothing, with
-- no error raised (conflicts are routine, and errors would fill the server log).
-- Phase 2 writes. An update cannot fail any more; an insert still can, when another commit
-- created the same key since phase 1. Then an exception undoes this commit's earlier writes; the
-- service reads SQLSTATE TS409 as a conflict.
--
-- p_receipt_key and p_receipt, when not NULL, record the turn's answer in turnstile_receipt in the
-- same transaction; a receipt that already exists is a conflict (the same activity committed
-- meanwhile), found in phase 1 or, if it appears concurrently, by the insert in phase 2.
--
-- Returns the key that conflicted, or NULL and every key's version afterwards (0 for a key that
-- was only checked for absence).
CREATE FUNCTION turnstile_commit(
    p_keys text[],
    p_expected bigint[],
    p_states jsonb[],
    p_receipt_key text,
    p_receipt jsonb,
    OUT conflict_key text,
    OUT versions bigint[]
)
LANGUAGE plpgsql AS $$
DECLARE
    n integer := coalesce(array_length(p_keys, 1), 0);
    seen bigint;
BEGIN
    FOR i IN 1 .. n LOOP
        IF p_expected[i] = 0 THEN
            PERFORM 1 FROM turnstile_state WHERE key = p_keys[i];
            IF FOUND THEN
                conflict_key := p_keys[i];
                RETURN;
            END IF;
        ELSE
            IF p_states[i] IS NULL THEN
                SELECT version INTO seen FROM turnstile_state WHERE key = p_keys[i] FOR SHARE;
            ELSE
                SELECT version INTO seen FROM turnstile_state WHERE key = p_keys[i] FOR UPDATE;
            END IF;
            IF NOT FOUND OR seen <> p_expected[i] THEN
                conflict_key := p_keys[i];
                RETURN;
            END IF;
        END IF;
    END LOOP;

    IF p_receipt_key IS NOT NULL THEN
        PERFORM 1 FROM turnstile_receipt WHERE key = p_receipt_key;
        IF FOUND THEN
            conflict_key := p_receipt_key;
            RETURN;
        END IF;
    END IF;

    versions := '{}';
    FOR i IN 1 .. n LOOP
        IF p_states[i] IS NULL THEN
            versions := versions || p_expected[i];
        ELSIF p_expected[i] = 0 THEN
            INSERT INTO turnstile_state (key, state, version)
            VALUES (p_keys[i], p_states[i], 1)
            ON CONFLICT (key) DO NOTHING;
            IF NOT FOUND THEN
                RAISE EXCEPTION USING
                    ERRCODE = 'TS409',
                    MESSAGE = 'turnstile commit conflict: key created concurrently',
                    DETAIL = p_keys[i];
            END IF;
            versions := versions || 1::bigint;
        ELSE
            UPDATE turnstile_state
               SET state = p_states[i], version = version + 1, updated_at = now()
             WHERE key = p_keys[i];
            versions := versions || (p_expected[i] + 1);
        END IF;
    END LOOP;

    IF p_receipt_key IS NOT NULL THEN
        INSERT INTO turnstile_receipt (key, payload)
        VALUES (p_receipt_key, p_receipt)
        ON CONFLICT (key) DO NOTHING;
        IF NOT FOUND THEN
            RAISE EXCEPTION USING
                ERRCODE = 'TS409',
                MESSAGE = 'turnstile commit conflict: receipt created concurrently',
                DETAIL = p_receipt_key;
        END IF;
    END IF;
END
$$;
