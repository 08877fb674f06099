-- What a 0.1.0 replica reaches through `public` during a rolling upgrade names a receipt that
-- exists by the name 0.1.0 knows, `turnstile_receipt_pkey`, also when two of its commits of one
-- activity race.
--
-- 0.1.0 tells "this activity committed already" (answer from the receipt) from a failure by that
-- constraint name. Since V5 its receipt goes through `turnstile_receipt_slots`, which raises a
-- receipt it finds under that name; but one written by a transaction not yet committed is not
-- found, and the insert then waits for it and fails on the slot's own index,
-- `turnstile_receipt_N_pkey`. An old replica took that for a store failure and answered INTERNAL
-- for an activity that had committed: seen in tests/third_party/upgrade.rs, a gateway's retry of
-- a call that timed out while the migration held the tables racing the call itself.
--
-- Both ways in are mended, where they exist (a database an older release laid out in `public`):
-- the view's insert trigger (V5) and the `public.turnstile_commit` wrapper the move left
-- (src/store/postgres/layout.rs). This release's own statements know both names and are not
-- changed. Written to run again harmlessly, as the last migration must be.
DO $$
DECLARE
    here text := current_schema();
BEGIN
    IF to_regprocedure(format('%I.turnstile_receipt_compat_insert()', here)) IS NOT NULL THEN
        EXECUTE format(
            'CREATE OR REPLACE FUNCTION %1$I.turnstile_receipt_compat_insert() RETURNS trigger
             LANGUAGE plpgsql SET search_path = %1$I, public AS $f$
             BEGIN
                 INSERT INTO turnstile_receipt (slot, key, payload)
                 SELECT unnest(turnstile_receipt_slots(NEW.key)), NEW.key, NEW.payload;
                 RETURN NEW;
             EXCEPTION WHEN unique_violation THEN
                 RAISE unique_violation USING
                     CONSTRAINT = ''turnstile_receipt_pkey'',
                     MESSAGE = ''turnstile receipt exists: the activity committed already'',
                     DETAIL = NEW.key;
             END
             $f$', here);
    END IF;
    IF here <> 'public' AND to_regprocedure(
        'public.turnstile_commit(text[], bigint[], jsonb[], text, jsonb)') IS NOT NULL
    THEN
        EXECUTE format(
            'CREATE OR REPLACE FUNCTION public.turnstile_commit(
                 p_keys text[], p_expected bigint[], p_states jsonb[], p_receipt_key text,
                 p_receipt jsonb, OUT conflict_key text, OUT versions bigint[])
             LANGUAGE plpgsql AS $f$
             BEGIN
                 SELECT c.conflict_key, c.versions INTO conflict_key, versions
                   FROM %1$I.turnstile_commit(p_keys, p_expected, p_states, p_receipt_key,
                                              p_receipt) c;
             EXCEPTION WHEN unique_violation THEN
                 RAISE unique_violation USING
                     CONSTRAINT = ''turnstile_receipt_pkey'',
                     MESSAGE = ''turnstile receipt exists: the activity committed already'',
                     DETAIL = p_receipt_key;
             END
             $f$', here);
    END IF;
END
$$;
