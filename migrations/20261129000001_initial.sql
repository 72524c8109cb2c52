-- oncepay's schema: merchants, their charges, the idempotency keys that guard
-- charge creation, and the simulated card processor's own ledger.

CREATE TABLE merchants (
    id           uuid        PRIMARY KEY,
    name         text        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    -- SHA-256 of the secret API key. The key itself is never stored.
    api_key_hash bytea       NOT NULL UNIQUE CHECK (length(api_key_hash) = 32),
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE charges (
    id              text        PRIMARY KEY CHECK (id LIKE 'ch\_%'),
    merchant_id     uuid        NOT NULL REFERENCES merchants (id),
    amount          bigint      NOT NULL CHECK (amount BETWEEN 1 AND 99999999),
    currency        text        NOT NULL CHECK (currency ~ '^[a-z]{3}$'),
    source          text        NOT NULL,
    description     text,
    metadata        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    status          text        NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    failure_code    text,
    failure_message text,
    amount_refunded bigint      NOT NULL DEFAULT 0 CHECK (amount_refunded BETWEEN 0 AND amount),
    created_at      timestamptz NOT NULL DEFAULT now(),
    CHECK ((status = 'failed') = (failure_code IS NOT NULL))
);

-- Listing: newest first per merchant, with (created_at, id) as the cursor.
CREATE INDEX charges_merchant_created_idx ON charges (merchant_id, created_at DESC, id DESC);
-- The sweeper looks for charges left pending by a crash.
CREATE INDEX charges_pending_idx ON charges (created_at) WHERE status = 'pending';

CREATE TABLE idempotency_keys (
    merchant_id           uuid        NOT NULL REFERENCES merchants (id),
    key                   text        NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    status                text        NOT NULL CHECK (status IN ('processing', 'completed')),
    request_method        text        NOT NULL,
    request_path          text        NOT NULL,
    -- SHA-256 over method, route and the canonical parameters.
    fingerprint           bytea       NOT NULL CHECK (length(fingerprint) = 32),
    -- Deferred so that the claim can be written before the charge in the same transaction.
    charge_id             text        REFERENCES charges (id) DEFERRABLE INITIALLY DEFERRED,
    -- The saved response, replayed byte for byte.
    response_status       smallint,
    response_content_type text,
    response_location     text,
    response_body         bytea,
    created_at            timestamptz NOT NULL DEFAULT now(),
    -- When the current holder took the key (or the sweeper last leased it).
    locked_at             timestamptz,
    expires_at            timestamptz NOT NULL,
    completed_at          timestamptz,
    PRIMARY KEY (merchant_id, key),
    CHECK (
        (status = 'processing' AND locked_at IS NOT NULL AND response_status IS NULL)
        OR (status = 'completed' AND response_status IS NOT NULL AND response_body IS NOT NULL
            AND response_content_type IS NOT NULL AND completed_at IS NOT NULL)
    )
);

CREATE INDEX idempotency_keys_expires_idx ON idempotency_keys (expires_at);
CREATE INDEX idempotency_keys_processing_idx ON idempotency_keys (locked_at) WHERE status = 'processing';
CREATE INDEX idempotency_keys_charge_idx ON idempotency_keys (charge_id);

-- The simulated card processor's ledger. It belongs to the "processor", not to
-- the service: the service never writes it in its own transactions. One row per
-- processor idempotency key, so a repeated authorization returns the first
-- outcome, and a void recorded first fences off any later authorization.
CREATE TABLE processor_operations (
    processor_key text        PRIMARY KEY,
    kind          text        NOT NULL CHECK (kind IN ('authorization', 'void')),
    outcome       text        NOT NULL CHECK (outcome IN ('succeeded', 'declined', 'voided')),
    amount        bigint,
    currency      text,
    source        text,
    decline_code  text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    CHECK ((kind = 'void') = (outcome = 'voided')),
    CHECK ((outcome = 'declined') = (decline_code IS NOT NULL))
);
