-- The reference consumer books money, not authorizations, keys its inbox by
-- the event it applies, and parks what it cannot apply. See docs/broker.md
-- ("The consumer").

-- The inbox's key is the event's own id (from the body, checked against
-- oncepay's record of the event), never the envelope's message id. Rows
-- written before were keyed by `Nats-Msg-Id`, which the relay sets to the
-- event's id, so they keep their meaning.
ALTER TABLE consumer_inbox RENAME COLUMN message_id TO event_id;

-- Money in is what a capture took: a charge paid at once books at its
-- charge.succeeded, one authorized first (capture=false) at its
-- charge.captured, for the amount captured.
ALTER TABLE ledger_entries
    DROP CONSTRAINT ledger_entries_type_check,
    ADD CONSTRAINT ledger_entries_type_check
        CHECK (type IN ('charge.succeeded', 'charge.captured', 'refund.succeeded'));

-- The money that moved, one row per succeeded charge or refund, signed (a
-- charge's in, a refund's out): the rule GET /v1/balance sums per currency,
-- `oncepay consume --check` compares the ledger with, and the ledger asks
-- whether a refund gave money back. A charge made with capture=false counts
-- what was captured, once captured (0 before); a refund of one never
-- captured is the release of its authorization, and moved no money, so it
-- has no row. Pending refunds do not count yet (their amount is only
-- reserved on the charge).
CREATE VIEW balance_movements AS
SELECT merchant_id, id AS object_id, 'charge' AS kind, currency,
       CASE WHEN NOT capture_later THEN amount
            WHEN captured_at IS NOT NULL THEN capture_amount
            ELSE 0 END AS amount
  FROM charges
 WHERE status = 'succeeded'
UNION ALL
SELECT r.merchant_id, r.id, 'refund', r.currency, -r.amount
  FROM refunds r JOIN charges c ON c.id = r.charge_id
 WHERE r.status = 'succeeded'
   AND (NOT c.capture_later OR c.captured_at IS NOT NULL);

-- What a consumer could not apply, kept instead of booked: a message that
-- disagrees with itself or with oncepay's record of the event, one that is
-- not an event (malformed, of an unknown type, oversize), and one whose
-- applying failed on each of CONSUMER_MAX_DELIVER deliveries. The message is
-- acknowledged (terminated) once its row is written, so it stops coming; the
-- stream keeps it, at `stream_sequence`.
CREATE TABLE consumer_dead_letters (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer        text        NOT NULL,
    -- A stable code: what `broker_parked_messages{reason}` counts.
    reason          text        NOT NULL CHECK (reason IN (
                                    'oversize', 'malformed', 'unknown_type', 'id_mismatch',
                                    'subject_mismatch', 'unknown_event', 'body_mismatch',
                                    'apply_failed')),
    -- What exactly disagreed or failed; never the payload itself.
    detail          text        NOT NULL,
    stream          text        NOT NULL,
    stream_sequence bigint      NOT NULL,
    subject         text        NOT NULL,
    -- Its `Nats-Msg-Id`, if it had one, and the id its body gave, if any.
    message_id      text,
    event_id        text,
    -- Deliveries of it so far, this one included.
    deliveries      bigint      NOT NULL,
    payload_bytes   integer     NOT NULL,
    -- The payload's first bytes (at most 1 KiB), as received.
    payload_prefix  bytea       NOT NULL,
    parked_at       timestamptz NOT NULL DEFAULT now(),
    -- A consumer that parked a message and died before its ack gets it
    -- again, and parks it again: one row.
    UNIQUE (consumer, stream, stream_sequence)
);

CREATE INDEX consumer_dead_letters_reason_idx ON consumer_dead_letters (consumer, reason);
