-- The conversation lock's tables: 1,024 empty tables whose only use is to be locked. A turn or a
-- lease that must hold its conversation against the other replicas takes
-- `LOCK TABLE turnstile_lock_NNNN IN EXCLUSIVE MODE` on the one its conversation key hashes to
-- (`lock_table` in src/store/postgres/lock.rs), in a transaction that then holds it.
--
-- Why tables and not advisory locks: a session waiting in `pg_advisory_lock` is running a
-- statement, and so holds a snapshot for all of its wait, which stops PostgreSQL from pruning any
-- row version newer than the wait's start. On a hot conversation there is always someone
-- waiting, and the conversation's row, updated by every turn of the holder, bloated: one row
-- grew to 1,700 pages in 16,000 turns, one update in seven no longer HOT. `LOCK TABLE` is the one
-- lock wait that takes no snapshot (on a session that has looked the table up before), so the
-- waiters hold nothing back. Two conversations that hash to the same table wait for each other
-- as one would; with 1,024 tables that takes two conversations contended at the same moment.
DO $$
BEGIN
    FOR i IN 0..1023 LOOP
        EXECUTE format('CREATE TABLE IF NOT EXISTS turnstile_lock_%s ()', lpad(i::text, 4, '0'));
    END LOOP;
END
$$;
