-- For the workshop's deliberately broken endpoint (POST /demo/naive/charges)
-- only: a key table written *after* the work, with nothing that makes the
-- lookup and the write atomic. Shares nothing with idempotency_keys.
CREATE TABLE naive_demo_keys (
    merchant_id uuid        NOT NULL REFERENCES merchants (id),
    key         text        NOT NULL,
    charge_id   text        NOT NULL REFERENCES charges (id),
    status      smallint    NOT NULL,
    content_type text       NOT NULL,
    response    bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (merchant_id, key)
);
