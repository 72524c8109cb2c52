-- Deliveries in flight: a claim sets `leased_until` to the end of its lease,
-- and the attempt's record (or the delivery's end) clears it. The claim
-- counts the leases not yet ended per endpoint and per merchant, across
-- every instance, and skips those already at their bound, so that one
-- merchant's slow endpoints cannot hold every sender.
ALTER TABLE webhook_deliveries ADD COLUMN leased_until timestamptz;

-- The leases the claim counts: a few rows, however long the backlog.
CREATE INDEX webhook_deliveries_leased_idx ON webhook_deliveries (endpoint_id)
    WHERE leased_until IS NOT NULL;
