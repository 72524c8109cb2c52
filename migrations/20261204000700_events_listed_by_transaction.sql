-- The events list pages by the id of the transaction that wrote each event,
-- not by `seq` alone. `seq` is handed out at insert and transactions commit
-- in any order, so a client paging forward past the newest event it saw
-- would skip an event with a smaller `seq` that committed later. The list
-- shows only events whose transaction id is below the oldest transaction
-- still at work (the xmin of its snapshot): every event that appears after
-- that comes from a later transaction id, so it is newer in the list's order
-- (txid, seq). See docs/decisions.md#events.
--
-- `txid` is `pg_current_xact_id()` (an xid8, which never wraps around) as a
-- bigint. Events written before this migration get 0: they are committed,
-- and among themselves `seq` keeps their order.
ALTER TABLE events ADD COLUMN txid bigint NOT NULL DEFAULT 0;
ALTER TABLE events ALTER COLUMN txid SET DEFAULT pg_current_xact_id()::text::bigint;

-- Listing: a merchant's events in (txid, seq) order, the cursor a range.
CREATE INDEX events_merchant_txid_seq_idx ON events (merchant_id, txid, seq);
DROP INDEX events_merchant_seq_idx;
