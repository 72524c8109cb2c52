-- Events through a message broker (NATS JetStream): the relay's position in
-- the outbox, and the reference consumer's inbox and ledger. See
-- docs/broker.md.

-- How far the relay has published events to a stream, in the order the
-- events list uses (txid, seq): written only after the broker acknowledged
-- every event up to it, so a relay that dies before writing it publishes
-- those events again (and the stream's duplicate window, or the consumer's
-- inbox, keeps them from counting twice).
CREATE TABLE relay_positions (
    stream     text        PRIMARY KEY,
    txid       bigint      NOT NULL,
    seq        bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The relay reads every merchant's events in (txid, seq) order.
CREATE INDEX events_txid_seq_idx ON events (txid, seq);

-- The consumer's inbox: one row per message a consumer has applied. The
-- insert that takes a row is what lets the effect happen; a redelivered
-- message finds its row and applies nothing.
CREATE TABLE consumer_inbox (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- The reference consumer's effect: a merchant ledger that books each
-- charge.succeeded (the amount in) and refund.succeeded (the amount out).
-- No unique constraint on the event, on purpose: the inbox is the guard, and
-- the rule is written once, where it is enforced.
CREATE TABLE ledger_entries (
    consumer    text        NOT NULL,
    event_id    text        NOT NULL,
    merchant_id uuid        NOT NULL,
    object_id   text        NOT NULL,
    type        text        NOT NULL CHECK (type IN ('charge.succeeded', 'refund.succeeded')),
    -- Signed minor units: a charge's amount in, a refund's out.
    amount      bigint      NOT NULL,
    currency    text        NOT NULL,
    booked_at   timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX ledger_entries_consumer_merchant_idx ON ledger_entries (consumer, merchant_id);
