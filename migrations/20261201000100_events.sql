-- Events: what happened to a merchant's charges and refunds, one row per
-- final state change, written in the same transaction as the change by the
-- statement after the one that decided it (a transactional outbox). A later
-- delivery worker reads them in `seq` order; nothing ever updates a row.
CREATE TABLE events (
    -- The order the events were written in: the list's order and cursor.
    seq             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id              text        NOT NULL UNIQUE CHECK (id ~ '^evt_[A-Za-z0-9]{24}$'),
    merchant_id     uuid        NOT NULL REFERENCES merchants (id),
    type            text        NOT NULL CHECK (type IN ('charge.succeeded', 'charge.failed',
                                    'charge.refunded', 'refund.succeeded', 'refund.failed')),
    -- The charge or refund the event is about (`data.object.id`).
    object_id       text        NOT NULL,
    -- `data.object`: the object exactly as the API rendered it at that moment.
    -- `json`, not `jsonb`, so the text (and its key order) is kept as written.
    data            json        NOT NULL,
    -- The request that settled the object (`X-Request-Id`); NULL when the
    -- sweeper did.
    request_id      text,
    -- The key that guards the object, if it has one.
    idempotency_key text,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- Listing: a merchant's events, newest first, `seq` as the cursor.
CREATE INDEX events_merchant_seq_idx ON events (merchant_id, seq DESC);
-- A charge or refund reaches a final state once, so it has one final-state
-- event at most; a bug that wrote a second would fail its settle instead.
-- (`charge.refunded` comes once per refund, so a charge may have several.)
CREATE UNIQUE INDEX events_one_final_state_idx ON events (object_id)
    WHERE type IN ('charge.succeeded', 'charge.failed', 'refund.succeeded', 'refund.failed');
