-- The workshop's webhook receivers (POST /demo/receiver/naive and
-- /demo/receiver/inbox, served only with DEMO_UNSAFE_ENDPOINTS=true): a
-- pretend order system on the far side of the webhook boundary, which ships
-- an order for each event about its run's charges. Nothing of the real API
-- reads or writes these tables.

-- A receiver of one workshop run, as its merchant set it up: the signing
-- secret it verifies deliveries with (the endpoint's whsec_, pasted in as a
-- merchant would paste it into its order system), and how it misbehaves on
-- purpose. A run's receivers belong to the merchant that registered them.
CREATE TABLE demo_receivers (
    run         text        NOT NULL CHECK (length(run) BETWEEN 1 AND 200),
    mode        text        NOT NULL CHECK (mode IN ('naive', 'inbox')),
    merchant_id uuid        NOT NULL REFERENCES merchants (id),
    secret      text        NOT NULL CHECK (secret ~ '^whsec_[A-Za-z0-9]{1,100}$'),
    -- The first fail_first deliveries of each event are answered 500 (with
    -- fault, 200 and `Oncepay-Fault: crash-after-delivery`) after the
    -- receiver's work committed, so the event is delivered again.
    fail_first  integer     NOT NULL DEFAULT 0 CHECK (fail_first BETWEEN 0 AND 10),
    fault       text        CHECK (fault IN ('crash-after-delivery')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run, mode)
);

-- The deliveries each receiver took in (signature verified), counted per
-- event: what the workshop's counts report, and the number that fail_first
-- goes by. Written for every delivery; nothing is decided by whether the
-- row was there before, so it is a counter, not an inbox.
CREATE TABLE demo_receiver_deliveries (
    run         text        NOT NULL,
    mode        text        NOT NULL,
    event_id    text        NOT NULL CHECK (length(event_id) BETWEEN 1 AND 255),
    deliveries  integer     NOT NULL CHECK (deliveries >= 1),
    first_at    timestamptz NOT NULL DEFAULT now(),
    last_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run, mode, event_id),
    FOREIGN KEY (run, mode) REFERENCES demo_receivers (run, mode)
);

-- The inbox receiver's record of the events it has acted on: one row per
-- event id, inserted in the transaction that ships, so an event id is
-- either in the inbox with its shipment or in neither.
CREATE TABLE demo_inbox (
    run         text        NOT NULL,
    event_id    text        NOT NULL CHECK (length(event_id) BETWEEN 1 AND 255),
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run, event_id)
);

-- The effect on the far side: one row per order shipped.
CREATE TABLE demo_shipments (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run         text        NOT NULL,
    mode        text        NOT NULL,
    event_id    text        NOT NULL,
    shipped_at  timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (run, mode) REFERENCES demo_receivers (run, mode)
);

-- The counts read one run's shipments.
CREATE INDEX demo_shipments_run_idx ON demo_shipments (run, mode);
