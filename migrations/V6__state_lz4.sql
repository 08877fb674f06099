-- States compressed with LZ4 instead of PostgreSQL's own pglz.
--
-- A row over about 2 KB is compressed as it is written (TOAST), and every turn writes its
-- conversation's row whole: with 64 KB of state pglz was the largest share of the database's work
-- per turn, more than parsing the JSON (callgrind, `bench/RESULTS.md`). LZ4 compresses several
-- times faster. Rows written from now on use it; rows already written keep pglz until their next
-- write, and PostgreSQL reads both, so replicas of earlier releases read and write them unchanged.
--
-- LZ4 needs PostgreSQL 14 or later built with it (the community packages, the managed services);
-- where it is missing the column keeps pglz. Written to run again harmlessly, as the last
-- migration must be (tests/api/schema_health.rs).
DO $$
BEGIN
    ALTER TABLE turnstile_state ALTER COLUMN state SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    RAISE NOTICE 'this PostgreSQL has no LZ4: turnstile_state.state keeps pglz';
END
$$;
