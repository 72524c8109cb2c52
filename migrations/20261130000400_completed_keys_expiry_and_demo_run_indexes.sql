-- The sweeper deletes expired keys, and only completed ones (a key still
-- processing is settled first, however old): an index on exactly those rows,
-- in expiry order, so each delete batch reads only rows it deletes. Every
-- other query on expires_at reads one key by its primary key, so the full
-- index on expires_at served only that delete: it goes, one index less to
-- write on every claim.
CREATE INDEX idempotency_keys_completed_expires_idx
    ON idempotency_keys (expires_at) WHERE status = 'completed';
DROP INDEX idempotency_keys_expires_idx;

-- GET /demo/effects counts one workshop run's charges (metadata.demo_run):
-- an index on exactly the tagged charges, so the count reads that run's rows,
-- never the merchant's whole history. Untagged charges (all real ones) are
-- not in it, so it costs them nothing but the predicate.
CREATE INDEX charges_demo_run_idx
    ON charges (merchant_id, (metadata->>'demo_run')) WHERE (metadata->>'demo_run') IS NOT NULL;
