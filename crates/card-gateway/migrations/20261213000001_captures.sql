-- Authorize now, capture later. An authorization asked with `capture: false`
-- holds its amount on the card until a capture takes all or part of it (the
-- rest goes back to the card) or a refund of the whole amount releases it.
-- A capture is an operation of its own, under its own key, naming the
-- payment it captures, as a refund does.
ALTER TABLE operations ADD COLUMN capture_later boolean NOT NULL DEFAULT false;

ALTER TABLE operations
    DROP CONSTRAINT operations_kind_check,
    ADD CONSTRAINT operations_kind_check
        CHECK (kind IN ('authorization', 'void', 'refund', 'capture')),
    DROP CONSTRAINT operations_outcome_check,
    ADD CONSTRAINT operations_outcome_check
        CHECK (outcome IN ('succeeded', 'declined', 'voided', 'refunded', 'refund_failed', 'captured')),
    ADD CONSTRAINT operations_capture_outcome_check CHECK ((kind = 'capture') = (outcome = 'captured')),
    DROP CONSTRAINT operations_check3,
    ADD CONSTRAINT operations_payment_key_check
        CHECK ((kind IN ('refund', 'capture')) = (payment_key IS NOT NULL)),
    ADD CONSTRAINT operations_capture_later_check CHECK (NOT capture_later OR kind = 'authorization');

-- A payment is captured once at most, whatever the keys asked under.
CREATE UNIQUE INDEX operations_one_capture_idx ON operations (account, payment_key)
    WHERE kind = 'capture';
