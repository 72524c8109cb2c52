-- For the workshop's deliberately broken POST /demo/naive/refunds only. Its
-- keys are claimed first, atomically, as they should be (the lesson is that
-- this is not enough): a key is inserted before the work and its answer
-- saved after. Shares nothing with idempotency_keys.
CREATE TABLE demo_naive_refund_keys (
    merchant_id  uuid        NOT NULL REFERENCES merchants (id),
    key          text        NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    -- NULL while the request is at work.
    status       smallint,
    content_type text,
    response     bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (merchant_id, key),
    CHECK ((status IS NULL) = (response IS NULL) AND (status IS NULL) = (content_type IS NULL))
);

-- The naive endpoint's refunds, apart from the real refunds table: it checks
-- what is left to refund with one statement and writes with another, so two
-- at once can refund more than was charged, which the real refunds' rules
-- would never allow. The money itself moves at the processor, under
-- `refund:<id>` as a real refund's does.
CREATE TABLE demo_naive_refunds (
    id          text        PRIMARY KEY CHECK (id ~ '^re_[A-Za-z0-9]{24}$'),
    merchant_id uuid        NOT NULL REFERENCES merchants (id),
    charge_id   text        NOT NULL REFERENCES charges (id),
    amount      bigint      NOT NULL CHECK (amount > 0),
    currency    text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- GET /demo/effects sums the money refunded from each of a run's payments,
-- found by the payment's key; and the simulated processor looks up whether
-- a payment was refunded before. Only refunds have a payment_key.
CREATE INDEX processor_operations_payment_key_idx
    ON processor_operations (payment_key) WHERE payment_key IS NOT NULL;
