-- Webhooks: endpoints a merchant registers, and one delivery of each event
-- to each endpoint that wants it, with every attempt recorded.

CREATE TABLE webhook_endpoints (
    id               text        PRIMARY KEY CHECK (id ~ '^we_[A-Za-z0-9]{24}$'),
    merchant_id      uuid        NOT NULL REFERENCES merchants (id),
    url              text        NOT NULL CHECK (url ~ '^https?://' AND length(url) <= 2048),
    -- Event types, or the one element '*' for every type.
    enabled_events   text[]      NOT NULL CHECK (cardinality(enabled_events) BETWEEN 1 AND 20),
    description      text        CHECK (length(description) <= 5000),
    -- The signing secret (`whsec_...`): HMAC needs it, so it is kept; the API
    -- shows it only in the answer to the create.
    secret           text        NOT NULL CHECK (secret ~ '^whsec_[A-Za-z0-9]{32}$'),
    status           text        NOT NULL DEFAULT 'enabled'
                                 CHECK (status IN ('enabled', 'disabled', 'deleted')),
    -- The first failure of the current unbroken run of failures; NULL after
    -- a success. An endpoint failing for WEBHOOK_DISABLE_AFTER is disabled.
    failing_since    timestamptz,
    -- The latest failure. A failure long after it (more than the longest
    -- wait between attempts) begins a new run: an endpoint that had nothing
    -- to receive was not failing meanwhile.
    last_failed_at   timestamptz,
    disabled_reason  text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    CHECK ((status = 'disabled') = (disabled_reason IS NOT NULL))
);

-- Listing, newest first; and the endpoints a settle fans an event out to.
CREATE INDEX webhook_endpoints_merchant_idx ON webhook_endpoints (merchant_id, created_at DESC, id DESC)
    WHERE status <> 'deleted';

-- One delivery per event and endpoint, written by the settle that writes the
-- event, in its transaction: an event is never without its deliveries.
CREATE TABLE webhook_deliveries (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_seq       bigint      NOT NULL REFERENCES events (seq),
    endpoint_id     text        NOT NULL REFERENCES webhook_endpoints (id),
    status          text        NOT NULL DEFAULT 'pending'
                                CHECK (status IN ('pending', 'succeeded', 'failed')),
    -- Attempts begun. A worker adds one when it claims the delivery, and only
    -- the worker holding that count may record the attempt's result.
    attempts        integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- When the next attempt is due. A claim moves it past the attempt's
    -- longest duration (the lease): a worker that dies mid-attempt leaves
    -- the delivery due again then, never lost.
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    -- Why a delivery ended failed: attempts exhausted, or the endpoint
    -- disabled or deleted.
    failure_reason  text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    UNIQUE (event_seq, endpoint_id),
    CHECK ((status = 'pending') = (finished_at IS NULL)),
    CHECK ((status = 'failed') = (failure_reason IS NOT NULL))
);

-- The worker's claim: pending deliveries in the order they are due.
CREATE INDEX webhook_deliveries_due_idx ON webhook_deliveries (next_attempt_at)
    WHERE status = 'pending';
-- The age of the oldest undelivered event, for /metrics.
CREATE INDEX webhook_deliveries_pending_created_idx ON webhook_deliveries (created_at)
    WHERE status = 'pending';
-- An endpoint's pending deliveries, ended when it is disabled or deleted.
CREATE INDEX webhook_deliveries_endpoint_pending_idx ON webhook_deliveries (endpoint_id)
    WHERE status = 'pending';

-- Every attempt that ran to an end, whatever it was. An attempt cut short by
-- a crash has no row; its delivery's `attempts` counts it.
CREATE TABLE webhook_attempts (
    delivery_id     bigint      NOT NULL REFERENCES webhook_deliveries (id),
    attempt         integer     NOT NULL CHECK (attempt >= 1),
    started_at      timestamptz NOT NULL,
    duration_ms     integer     NOT NULL CHECK (duration_ms >= 0),
    -- The receiver's status code; NULL when none came (timeout, refused, ...).
    response_status smallint,
    -- What went wrong, in a few words; NULL for a 2xx.
    error           text,
    PRIMARY KEY (delivery_id, attempt)
);

