-- Stripe's refund event types: a succeeded refund writes `refund.created`,
-- Stripe's name, where it wrote `refund.succeeded`, which Stripe has not.
-- The rows written under the old name take the new one, so that a list
-- filtered by type, a webhook endpoint and a ledger see one name for one
-- thing (docs/decisions.md, "Stripe's refund event types"). An event's
-- object does not name its type, so nothing else in it changes.
ALTER TABLE events DROP CONSTRAINT events_type_check;
UPDATE events SET type = 'refund.created' WHERE type = 'refund.succeeded';
ALTER TABLE events
    ADD CONSTRAINT events_type_check CHECK (type IN ('charge.succeeded', 'charge.failed',
        'charge.captured', 'charge.expired', 'charge.refunded', 'charge.updated',
        'refund.created', 'refund.failed', 'refund.updated'));

-- A charge or refund reaches a final state once: one final-state event at most.
DROP INDEX events_one_final_state_idx;
CREATE UNIQUE INDEX events_one_final_state_idx ON events (object_id)
    WHERE type IN ('charge.succeeded', 'charge.failed', 'refund.created', 'refund.failed');

-- An endpoint enabled for `refund.succeeded` is enabled for `refund.created`:
-- its list, kept sorted (as the API writes it, byte order), names it instead.
UPDATE webhook_endpoints
   SET enabled_events = ARRAY(SELECT DISTINCT (CASE WHEN e = 'refund.succeeded'
                                                    THEN 'refund.created' ELSE e END) COLLATE "C"
                                FROM unnest(enabled_events) AS e
                               ORDER BY 1)
 WHERE 'refund.succeeded' = ANY (enabled_events);

-- The reference consumer's ledger books refunds under the new name too.
ALTER TABLE ledger_entries DROP CONSTRAINT ledger_entries_type_check;
UPDATE ledger_entries SET type = 'refund.created' WHERE type = 'refund.succeeded';
ALTER TABLE ledger_entries
    ADD CONSTRAINT ledger_entries_type_check
        CHECK (type IN ('charge.succeeded', 'charge.captured', 'refund.created'));
