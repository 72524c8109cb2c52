-- Refunds: a second operation guarded by idempotency keys. A refund reserves
-- its amount on the charge (charges.amount_refunded) in the transaction that
-- creates it, so concurrent refunds can never add up to more than was charged.

CREATE TABLE refunds (
    id          text        PRIMARY KEY CHECK (id ~ '^re_[A-Za-z0-9]{24}$'),
    merchant_id uuid        NOT NULL REFERENCES merchants (id),
    charge_id   text        NOT NULL REFERENCES charges (id),
    amount      bigint      NOT NULL CHECK (amount > 0),
    currency    text        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    status      text        NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    reason      text        CHECK (reason IN ('duplicate', 'fraudulent', 'requested_by_customer')),
    metadata    jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX refunds_charge_idx ON refunds (charge_id);
-- The balance sums a merchant's refunds.
CREATE INDEX refunds_merchant_idx ON refunds (merchant_id);
-- The sweeper looks for refunds left pending by a crash.
CREATE INDEX refunds_pending_idx ON refunds (created_at) WHERE status = 'pending';

-- A key guards a charge or a refund, never both. Deferred, like charge_id, so
-- that the claim can be written before the refund in the same transaction.
ALTER TABLE idempotency_keys
    ADD COLUMN refund_id text REFERENCES refunds (id) DEFERRABLE INITIALLY DEFERRED,
    ADD CONSTRAINT idempotency_keys_one_resource_check
        CHECK (charge_id IS NULL OR refund_id IS NULL);

CREATE INDEX idempotency_keys_refund_idx ON idempotency_keys (refund_id);

-- The simulated processor records refunds too: one row per refund processor
-- key (`refund:re_...`), naming the payment it gives money back from.
ALTER TABLE processor_operations
    ADD COLUMN payment_key text REFERENCES processor_operations (processor_key),
    DROP CONSTRAINT processor_operations_kind_check,
    DROP CONSTRAINT processor_operations_outcome_check,
    ADD CONSTRAINT processor_operations_kind_check
        CHECK (kind IN ('authorization', 'void', 'refund')),
    ADD CONSTRAINT processor_operations_outcome_check
        CHECK (outcome IN ('succeeded', 'declined', 'voided', 'refunded')),
    ADD CONSTRAINT processor_operations_refund_check
        CHECK ((kind = 'refund') = (outcome = 'refunded')
               AND (kind = 'refund') = (payment_key IS NOT NULL));
