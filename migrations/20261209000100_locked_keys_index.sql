-- The sweeper finds keys in flight by when they were claimed. Their index
-- was partial on `status = 'processing'`, which every statement that finds
-- a key by its charge or refund `AND status = 'processing'` (the settle
-- among them) could use as well, and the planner did: the index holds few
-- live rows. But each key completed since the table's last vacuum leaves
-- a dead entry in it, and the planner's choice walked them one by one
-- (32,185 of them, 2.2 ms, for one settle on a server with autovacuum
-- off). An index partial on `locked_at IS NOT NULL` serves the sweeper's
-- `locked_at < ...` just as well, and no statement that names a key's
-- charge or refund can be planned through it: its predicate follows from
-- none of theirs. The key is then found through its charge's or refund's
-- own index, one entry.
DROP INDEX idempotency_keys_processing_idx;
CREATE INDEX idempotency_keys_locked_idx ON idempotency_keys (locked_at)
    WHERE locked_at IS NOT NULL;
