-- Authorize now, capture later. A charge made with `capture=false` is
-- authorized: its amount is held on the card, and it is paid only once a
-- capture (`POST /v1/charges/{id}/capture`) takes all or part of it, within
-- the authorization window. A capture is a guarded operation of its own,
-- under its own key: its claim reserves the amount to capture on the charge
-- in one conditional update, so a charge is captured once at most, whatever
-- keys ask; the processor captures under a key derived from the charge; the
-- settle marks the capture done.
ALTER TABLE charges
    -- Made with capture=false.
    ADD COLUMN capture_later  boolean     NOT NULL DEFAULT false,
    -- What a capture takes: set once, by the capture's claim.
    ADD COLUMN capture_amount bigint,
    -- When the capture was asked, and reserved.
    ADD COLUMN capture_asked_at timestamptz,
    -- When the processor confirmed the capture; NULL while it is in flight.
    ADD COLUMN captured_at    timestamptz,
    ADD CONSTRAINT charges_capture_check CHECK (
        (capture_amount IS NULL OR (capture_later AND capture_amount BETWEEN 1 AND amount))
        AND (capture_amount IS NULL) = (capture_asked_at IS NULL)
        AND (captured_at IS NULL OR capture_amount IS NOT NULL));

-- The sweeper looks for captures left in flight by a crash.
CREATE INDEX charges_capturing_idx ON charges (capture_asked_at)
    WHERE capture_amount IS NOT NULL AND captured_at IS NULL;

-- A capture writes `charge.captured`, once per charge at most.
ALTER TABLE events
    DROP CONSTRAINT events_type_check,
    ADD CONSTRAINT events_type_check CHECK (type IN ('charge.succeeded', 'charge.failed',
        'charge.captured', 'charge.refunded', 'charge.updated', 'refund.succeeded',
        'refund.failed', 'refund.updated'));
CREATE UNIQUE INDEX events_one_capture_idx ON events (object_id) WHERE type = 'charge.captured';

-- A key guards a charge, a refund or a charge's capture: one of them.
ALTER TABLE idempotency_keys
    ADD COLUMN capture_of text REFERENCES charges (id) DEFERRABLE INITIALLY DEFERRED,
    DROP CONSTRAINT idempotency_keys_one_resource_check,
    ADD CONSTRAINT idempotency_keys_one_resource_check
        CHECK (num_nonnulls(charge_id, refund_id, capture_of) <= 1);
CREATE INDEX idempotency_keys_capture_idx ON idempotency_keys (capture_of);

-- The key rules, which name the record a key guards, now name a capture too
-- (`for_capture_of`); nothing else in them changes. The claim and the
-- completion as instances of the version before call them stay, for the
-- length of a rolling upgrade, each the same rule written once, below.
CREATE FUNCTION idempotency_key_claim(
    for_merchant_id uuid, for_key text, for_method text, for_path text,
    for_fingerprint bytea, for_charge_id text, for_refund_id text, ttl_ms float8,
    deadline timestamptz, age_ms float8, may_insert boolean, for_request_id text,
    for_capture_of text
) RETURNS SETOF boolean
LANGUAGE plpgsql ROWS 1
AS $$
BEGIN
    RETURN QUERY
    INSERT INTO idempotency_keys AS k
           (merchant_id, key, status, request_method, request_path, fingerprint,
            charge_id, refund_id, created_at, locked_at, expires_at, request_id, capture_of)
    SELECT for_merchant_id, for_key, 'processing', for_method, for_path, for_fingerprint,
           for_charge_id, for_refund_id,
           now(), now(), now() + ttl_ms * interval '1 millisecond', for_request_id,
           for_capture_of
     WHERE may_insert AND statement_timestamp() < deadline
    ON CONFLICT (merchant_id, key) DO UPDATE SET
        status = 'processing',
        request_method = EXCLUDED.request_method,
        request_path = EXCLUDED.request_path,
        fingerprint = EXCLUDED.fingerprint,
        charge_id = EXCLUDED.charge_id,
        refund_id = EXCLUDED.refund_id,
        response_status = NULL,
        response_content_type = NULL,
        response_location = NULL,
        response_body = NULL,
        created_at = EXCLUDED.created_at,
        locked_at = EXCLUDED.locked_at,
        expires_at = EXCLUDED.expires_at,
        completed_at = NULL,
        request_id = EXCLUDED.request_id,
        capture_of = EXCLUDED.capture_of
    WHERE idempotency_key_takeover(k.status, k.expires_at, k.completed_at, age_ms)
    RETURNING k.xmax <> 0;
END
$$;

CREATE OR REPLACE FUNCTION idempotency_key_claim(
    for_merchant_id uuid, for_key text, for_method text, for_path text,
    for_fingerprint bytea, for_charge_id text, for_refund_id text, ttl_ms float8,
    deadline timestamptz, age_ms float8, may_insert boolean, for_request_id text
) RETURNS SETOF boolean
LANGUAGE sql ROWS 1
AS $$
    SELECT idempotency_key_claim(for_merchant_id, for_key, for_method, for_path,
                                 for_fingerprint, for_charge_id, for_refund_id, ttl_ms,
                                 deadline, age_ms, may_insert, for_request_id, NULL)
$$;

CREATE FUNCTION idempotency_key_complete(
    for_charge_id text, for_refund_id text, for_capture_of text, for_merchant_id uuid,
    for_key text,
    new_response_status smallint, new_response_content_type text,
    new_response_location text, new_response_body bytea, ttl_ms float8
) RETURNS SETOF text
LANGUAGE plpgsql ROWS 1
AS $$
BEGIN
    RETURN QUERY
    UPDATE idempotency_keys k
       SET status = 'completed',
           response_status = new_response_status,
           response_content_type = new_response_content_type,
           response_location = new_response_location,
           response_body = new_response_body,
           completed_at = now(),
           locked_at = NULL,
           expires_at = greatest(k.expires_at, now() + ttl_ms * interval '1 millisecond')
     WHERE k.status = 'processing'
       AND (k.merchant_id, k.key) = (
               SELECT merchant_id, key FROM idempotency_keys WHERE charge_id = for_charge_id
               UNION ALL
               SELECT merchant_id, key FROM idempotency_keys WHERE refund_id = for_refund_id
               UNION ALL
               -- A charge is captured once, so one key at most is capturing it.
               SELECT merchant_id, key FROM idempotency_keys
                WHERE capture_of = for_capture_of AND status = 'processing'
               UNION ALL
               SELECT for_merchant_id, for_key WHERE for_key IS NOT NULL
               LIMIT 1)
    RETURNING k.key;
END
$$;

CREATE OR REPLACE FUNCTION idempotency_key_complete(
    for_charge_id text, for_refund_id text, for_merchant_id uuid, for_key text,
    new_response_status smallint, new_response_content_type text,
    new_response_location text, new_response_body bytea, ttl_ms float8
) RETURNS SETOF text
LANGUAGE sql ROWS 1
AS $$
    SELECT idempotency_key_complete(for_charge_id, for_refund_id, NULL, for_merchant_id,
                                    for_key, new_response_status, new_response_content_type,
                                    new_response_location, new_response_body, ttl_ms)
$$;

-- Every read sees the capture a key guards too (a view may gain columns at its end).
CREATE OR REPLACE VIEW idempotency_key_reads AS
SELECT merchant_id, key, status, request_method, request_path, fingerprint,
       charge_id, refund_id, response_status, response_content_type,
       response_location, response_body, created_at, locked_at, expires_at,
       completed_at,
       (extract(epoch from expires_at - statement_timestamp()) * 1000)::float8 AS remaining_ms,
       request_id, capture_of
  FROM idempotency_keys;
