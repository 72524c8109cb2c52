-- The sweeper deletes expired keys, and only completed ones (a key still
-- processing is settled first, however old): an index on exactly those rows,
-- in expiry order, so each delete batch reads only rows it deletes. Every
-- other query on expires_at reads one key by its primary key, so the full
-- index on expires_at served only that delete: it goes, one index less to
-- write on every claim.
CREATE INDEX idempotency_keys_completed_expires_idx
    ON idempotency_keys (expires_at) WHERE status = 'completed';
DROP INDEX idempotency_keys_expires_idx;
