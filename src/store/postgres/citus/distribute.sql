-- Turnstile's tables spread over a Citus cluster (src/store/postgres/citus.rs): run once by
-- `turnstile migrate` on a coordinator, after the migrations, in one transaction; rows already
-- there (a single-node database moved to Citus) are kept and moved to their shards.
--
-- Rows are distributed by `shard`: the first four parts of the key, so `{bot}/{channel}/
-- conversations/{conversation}` for a conversation's scope, its private scopes, its hold and its
-- receipts, and `{bot}/{channel}/users/{user}` for a user's scope. A turn that writes only its
-- conversation's keys and its receipt then writes one shard, on one node, and commits without
-- two-phase commit; one that also writes the user's scope commits on two shards, atomically,
-- through Citus' two-phase commit. Citus refuses a generated distribution column, so `shard` is
-- a plain column that every insert writes (the statements compute it with
-- `turnstile_key_shard`). Each primary key becomes (shard, key): Citus requires the
-- distribution column in every unique index, and since the shard is a function of the key the
-- uniqueness is the same.
--
-- The tombstones and the receipts' clock become reference tables, a copy on every node, read
-- locally by whichever node runs a commit. The 1,024 conversation lock tables stay where they
-- are, on the coordinator, where every replica's `LOCK TABLE` meets. The trigger that checks an
-- older release's creates against the tombstones goes: Citus refuses a trigger on a distributed
-- table, and releases before 0.2 never serve a Citus cluster (citus.rs refuses to distribute
-- while their views are in `public`).

DROP TRIGGER IF EXISTS turnstile_state_created ON turnstile_state;

ALTER TABLE turnstile_state ADD COLUMN IF NOT EXISTS shard text;
UPDATE turnstile_state SET shard = turnstile_key_shard(key) WHERE shard IS NULL;
ALTER TABLE turnstile_state ALTER COLUMN shard SET NOT NULL,
    DROP CONSTRAINT turnstile_state_pkey,
    ADD CONSTRAINT turnstile_state_pkey PRIMARY KEY (shard, key);

ALTER TABLE turnstile_receipt_legacy ADD COLUMN IF NOT EXISTS shard text;
UPDATE turnstile_receipt_legacy SET shard = turnstile_key_shard(key) WHERE shard IS NULL;
ALTER TABLE turnstile_receipt_legacy ALTER COLUMN shard SET NOT NULL,
    DROP CONSTRAINT turnstile_receipt_legacy_pkey,
    ADD CONSTRAINT turnstile_receipt_legacy_pkey PRIMARY KEY (shard, key);

ALTER TABLE turnstile_receipt ADD COLUMN IF NOT EXISTS shard text;
UPDATE turnstile_receipt SET shard = turnstile_key_shard(key) WHERE shard IS NULL;
ALTER TABLE turnstile_receipt ALTER COLUMN shard SET NOT NULL;
-- Each slot's own key, by the same name, so that a duplicate is still read as "committed
-- already" (src/store/postgres.rs, `is_receipt_taken`).
ALTER TABLE turnstile_receipt_0 DROP CONSTRAINT turnstile_receipt_0_pkey,
    ADD CONSTRAINT turnstile_receipt_0_pkey PRIMARY KEY (shard, key);
ALTER TABLE turnstile_receipt_1 DROP CONSTRAINT turnstile_receipt_1_pkey,
    ADD CONSTRAINT turnstile_receipt_1_pkey PRIMARY KEY (shard, key);
ALTER TABLE turnstile_receipt_2 DROP CONSTRAINT turnstile_receipt_2_pkey,
    ADD CONSTRAINT turnstile_receipt_2_pkey PRIMARY KEY (shard, key);
ALTER TABLE turnstile_receipt_3 DROP CONSTRAINT turnstile_receipt_3_pkey,
    ADD CONSTRAINT turnstile_receipt_3_pkey PRIMARY KEY (shard, key);

SELECT create_reference_table('turnstile_tombstone');
SELECT create_reference_table('turnstile_receipt_clock');
SELECT create_distributed_table('turnstile_state', 'shard');
SELECT create_distributed_table('turnstile_receipt', 'shard', colocate_with => 'turnstile_state');
SELECT create_distributed_table('turnstile_receipt_legacy', 'shard',
                                colocate_with => 'turnstile_state');

-- Rows that were there before are now in the shards; the coordinator's copies, no longer read,
-- are freed.
SELECT truncate_local_data_after_distributing_table('turnstile_state');
SELECT truncate_local_data_after_distributing_table('turnstile_receipt_0');
SELECT truncate_local_data_after_distributing_table('turnstile_receipt_1');
SELECT truncate_local_data_after_distributing_table('turnstile_receipt_2');
SELECT truncate_local_data_after_distributing_table('turnstile_receipt_3');
SELECT truncate_local_data_after_distributing_table('turnstile_receipt_legacy');
SELECT truncate_local_data_after_distributing_table('turnstile_tombstone');
SELECT truncate_local_data_after_distributing_table('turnstile_receipt_clock');
