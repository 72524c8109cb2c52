-- The card gateway's ledger, in the gateway's own database: one row per
-- idempotency key, written once. The first writer under a key wins: a
-- repeated authorization or refund reads the row back instead of moving
-- money again, and a void recorded first fences off any later
-- authorization under its key.
CREATE TABLE operations (
    key          text        PRIMARY KEY CHECK (length(key) BETWEEN 1 AND 255),
    kind         text        NOT NULL CHECK (kind IN ('authorization', 'void', 'refund')),
    outcome      text        NOT NULL
                 CHECK (outcome IN ('succeeded', 'declined', 'voided', 'refunded', 'refund_failed')),
    amount       bigint      CHECK (amount > 0),
    currency     text,
    -- The card token of an authorization.
    source       text,
    decline_code text,
    -- The authorization a refund gives money back from.
    payment_key  text        REFERENCES operations (key),
    created      timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'void') = (outcome = 'voided')),
    CHECK ((kind = 'authorization') = (outcome IN ('succeeded', 'declined'))),
    CHECK ((kind = 'refund') = (outcome IN ('refunded', 'refund_failed'))),
    CHECK ((kind = 'refund') = (payment_key IS NOT NULL)),
    CHECK ((outcome = 'declined') = (decline_code IS NOT NULL)),
    CHECK ((kind = 'void') = (amount IS NULL))
);

-- A payment's refunds, read to check a new one against what is left.
CREATE INDEX operations_payment_key_idx ON operations (payment_key) WHERE payment_key IS NOT NULL;

-- The ledger by time, a page at a time (`GET /v1/operations`).
CREATE INDEX operations_created_key_idx ON operations (created, key);
