-- Erasure and expiry: deleting a state row must not let its versions start again. (Written to
-- run again harmlessly.)
--
-- Every key's versions are its ETags: a turn that read a row at version v commits with
-- `UPDATE … WHERE version = v`. If a row were simply deleted, the next turn would create the key
-- again at version 1, and a turn that had read the deleted row at v — still running, or a
-- replica's cached guess — would commit on top of the new row as soon as it reached v again,
-- writing back the data that was erased. So a deleted row leaves a tombstone: the hash of its key
-- (not the key: no id stays behind) and its last version. The key can only be created again above
-- that version, which no turn ever saw. Tombstones are pruned after a day, long past the end of
-- any turn that could have read the row.
CREATE TABLE IF NOT EXISTS turnstile_tombstone (
    key_hash  bytea       PRIMARY KEY,
    version   bigint      NOT NULL,
    erased_at timestamptz NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION turnstile_key_hash(p_key text) RETURNS bytea
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
AS $$ SELECT sha256(convert_to(p_key, 'UTF8')) $$;

-- Every insert into turnstile_state passes here, whoever wrote it. This release's creates check
-- the key's tombstone themselves and create it above it (the statements say how; they would do
-- without this trigger, as on a distributed database that has none). An older release's create,
-- at version 1, knows nothing of tombstones and checks that its row landed at 1: over a tombstone
-- nothing is inserted, a conflict (it retries, and gives up with a status its caller retries
-- elsewhere) rather than a row at a version a turn that read the deleted row could find again.
CREATE OR REPLACE FUNCTION turnstile_state_created() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    gone bigint;
BEGIN
    SELECT version INTO gone FROM turnstile_tombstone WHERE key_hash = turnstile_key_hash(NEW.key);
    IF gone IS NOT NULL AND NEW.version <= gone THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS turnstile_state_created ON turnstile_state;
CREATE TRIGGER turnstile_state_created BEFORE INSERT ON turnstile_state
    FOR EACH ROW EXECUTE FUNCTION turnstile_state_created();

-- Whose a key is, for erasure: `{channel}/{conversation}` of a conversation's keys (its scope,
-- its private scopes, its hold, its receipts) and `{channel}/{user}` of a user's (the user scope
-- and the private scopes), both as escaped in the key, NULL otherwise. Keys are
-- `{bot}/{channel}/conversations/{c}[/users/{u}|/%hold|/activities/{a}]` and
-- `{bot}/{channel}/users/{u}`; parts never contain `/` (src/state/key.rs).
CREATE OR REPLACE FUNCTION turnstile_key_conversation(p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
AS $$
    SELECT CASE WHEN split_part(p_key, '/', 3) = 'conversations'
                THEN split_part(p_key, '/', 2) || '/' || split_part(p_key, '/', 4) END
$$;

CREATE OR REPLACE FUNCTION turnstile_key_user(p_key text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
AS $$
    SELECT CASE
        WHEN split_part(p_key, '/', 3) = 'users' AND split_part(p_key, '/', 5) = ''
            THEN split_part(p_key, '/', 2) || '/' || split_part(p_key, '/', 4)
        WHEN split_part(p_key, '/', 3) = 'conversations' AND split_part(p_key, '/', 5) = 'users'
             AND split_part(p_key, '/', 7) = ''
            THEN split_part(p_key, '/', 2) || '/' || split_part(p_key, '/', 6)
    END
$$;

-- Indexes on expressions of the key, which no update changes: the updates of a turn stay HOT.
-- On a large table each build holds off writes while it runs; build them beforehand with
-- `CREATE INDEX CONCURRENTLY` under these names (README, "Upgrades"), and these do nothing.
CREATE INDEX IF NOT EXISTS turnstile_state_conversation
    ON turnstile_state (turnstile_key_conversation(key))
    WHERE turnstile_key_conversation(key) IS NOT NULL;
CREATE INDEX IF NOT EXISTS turnstile_state_user
    ON turnstile_state (turnstile_key_user(key))
    WHERE turnstile_key_user(key) IS NOT NULL;
-- A receipt names the user whose activity it answered (`"user"`, as `{channel}/{user}`), written
-- by this release on; its conversation is in its key.
CREATE INDEX IF NOT EXISTS turnstile_receipt_conversation
    ON turnstile_receipt (turnstile_key_conversation(key));
CREATE INDEX IF NOT EXISTS turnstile_receipt_user
    ON turnstile_receipt ((payload->>'user'))
    WHERE payload ? 'user';

-- turnstile_commit as in V1, with creates that respect tombstones: p_expected[i] is the version
-- the turn saw; 0 for "did not exist" (an older release: created at 1, or a conflict over a
-- tombstone); -n for "did not exist, gone at n - 1" (this release: created at n exactly, or a
-- conflict). Returns the versions written, as read back. Each key's values are copied into
-- scalar variables before the statements use them: Citus 13.2 crashes on an element of an array
-- parameter in a distributed UPDATE's SET (../shared/citus/README.md), and a scalar works.
CREATE OR REPLACE FUNCTION turnstile_commit(
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
            -- Created at -expected, if the key's tombstone (none: 0) is the version before.
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
