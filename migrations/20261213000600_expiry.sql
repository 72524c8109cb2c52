-- An authorization not captured within CAPTURE_WINDOW expires, as at Stripe:
-- the sweeper releases it with a refund of the whole amount, reason
-- `expired_uncaptured_charge`, and writes `charge.expired` (once per charge)
-- where a refund writes `charge.refunded`.
ALTER TABLE refunds
    DROP CONSTRAINT refunds_reason_check,
    ADD CONSTRAINT refunds_reason_check CHECK (reason IN ('duplicate', 'fraudulent',
        'requested_by_customer', 'expired_uncaptured_charge'));

ALTER TABLE events
    DROP CONSTRAINT events_type_check,
    ADD CONSTRAINT events_type_check CHECK (type IN ('charge.succeeded', 'charge.failed',
        'charge.captured', 'charge.expired', 'charge.refunded', 'charge.updated',
        'refund.succeeded', 'refund.failed', 'refund.updated'));
CREATE UNIQUE INDEX events_one_expiry_idx ON events (object_id) WHERE type = 'charge.expired';

-- The sweeper looks for authorizations neither captured nor released.
CREATE INDEX charges_uncaptured_idx ON charges (created_at)
    WHERE capture_later AND status = 'succeeded' AND capture_amount IS NULL
      AND amount_refunded = 0;
