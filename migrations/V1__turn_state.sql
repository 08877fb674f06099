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
-- Pruned by age in the background. Rows arrive in time order, so a BRIN index finds the old ones
-- at a fraction of a B-tree's cost on every turn's insert.
CREATE TABLE turnstile_receipt (
    key        text        PRIMARY KEY,
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX turnstile_receipt_created_at ON turnstile_receipt USING brin (created_at);

-- Applies one turn's commit in a single round trip, all keys or none.
--
-- For each key i (the caller sorts keys, so every commit locks in one order): p_expected[i] is
-- the version the turn saw, 0 for "did not exist"; p_states[i] is the new state, NULL for a key
-- the turn only read. p_receipt_key and p_receipt, when not NULL, record the turn's answer in
-- turnstile_receipt in the same transaction.
--
-- First the keys only read are checked, and locked FOR SHARE so they cannot move before the
-- commit. Then each write is itself the check: `UPDATE ... WHERE version = expected` (or an
-- insert that does nothing if the key exists) touches no row when the key moved. A failed check
-- before anything was written is the ordinary outcome "conflict": the function returns the key,
-- no error is raised (conflicts are routine, and errors would fill the server log). A failure
-- after a write — a second key moved, or the receipt exists because the same activity committed
-- meanwhile — raises SQLSTATE TS409, which undoes this commit's writes; the service reads it as a
-- conflict too. The common turn (one scope written, a receipt) runs two statements.
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
    wrote boolean := false;
BEGIN
    FOR i IN 1 .. n LOOP
        CONTINUE WHEN p_states[i] IS NOT NULL;
        IF p_expected[i] = 0 THEN
            PERFORM 1 FROM turnstile_state WHERE key = p_keys[i];
            IF FOUND THEN
                conflict_key := p_keys[i];
                RETURN;
            END IF;
        ELSE
            SELECT version INTO seen FROM turnstile_state WHERE key = p_keys[i] FOR SHARE;
            IF NOT FOUND OR seen <> p_expected[i] THEN
                conflict_key := p_keys[i];
                RETURN;
            END IF;
        END IF;
    END LOOP;

    versions := '{}';
    FOR i IN 1 .. n LOOP
        IF p_states[i] IS NULL THEN
            versions := versions || p_expected[i];
            CONTINUE;
        END IF;
        IF p_expected[i] = 0 THEN
            INSERT INTO turnstile_state (key, state, version)
            VALUES (p_keys[i], p_states[i], 1)
            ON CONFLICT (key) DO NOTHING;
        ELSE
            UPDATE turnstile_state
               SET state = p_states[i], version = version + 1, updated_at = now()
             WHERE key = p_keys[i] AND version = p_expected[i];
        END IF;
        IF NOT FOUND THEN
            IF NOT wrote THEN
                conflict_key := p_keys[i];
                versions := NULL;
                RETURN;
            END IF;
            RAISE EXCEPTION USING
                ERRCODE = 'TS409',
                MESSAGE = 'turnstile commit conflict: a key moved after another was written',
                DETAIL = p_keys[i];
        END IF;
        wrote := true;
        versions := versions || (p_expected[i] + 1);
    END LOOP;

    IF p_receipt_key IS NOT NULL THEN
        INSERT INTO turnstile_receipt (key, payload)
        VALUES (p_receipt_key, p_receipt)
        ON CONFLICT (key) DO NOTHING;
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
