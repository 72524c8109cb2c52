-- The request that claimed each idempotency key: its `X-Request-Id`, which
-- every replay of the key's answer names in `Original-Request`, as Stripe's
-- replays do. Keys claimed before this column existed have none (NULL): their
-- replays go without the header. A claim that takes an expired key over
-- writes its own.
ALTER TABLE idempotency_keys ADD COLUMN request_id text;

-- The claim of 20261211000100_key_rules.sql, recording the claiming request
-- too (`for_request_id`). The statement is otherwise the same.
CREATE FUNCTION idempotency_key_claim(
    for_merchant_id uuid, for_key text, for_method text, for_path text,
    for_fingerprint bytea, for_charge_id text, for_refund_id text, ttl_ms float8,
    deadline timestamptz, age_ms float8, may_insert boolean, for_request_id text
) RETURNS SETOF boolean
LANGUAGE plpgsql ROWS 1
AS $$
BEGIN
    RETURN QUERY
    INSERT INTO idempotency_keys AS k
           (merchant_id, key, status, request_method, request_path, fingerprint,
            charge_id, refund_id, created_at, locked_at, expires_at, request_id)
    SELECT for_merchant_id, for_key, 'processing', for_method, for_path, for_fingerprint,
           for_charge_id, for_refund_id,
           now(), now(), now() + ttl_ms * interval '1 millisecond', for_request_id
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
        request_id = EXCLUDED.request_id
    WHERE idempotency_key_takeover(k.status, k.expires_at, k.completed_at, age_ms)
    RETURNING k.xmax <> 0;
END
$$;

-- The claim as instances of the version before call it (no request id), for
-- the length of a rolling upgrade: the same rule, written once, above.
CREATE OR REPLACE FUNCTION idempotency_key_claim(
    for_merchant_id uuid, for_key text, for_method text, for_path text,
    for_fingerprint bytea, for_charge_id text, for_refund_id text, ttl_ms float8,
    deadline timestamptz, age_ms float8, may_insert boolean
) RETURNS SETOF boolean
LANGUAGE sql ROWS 1
AS $$
    SELECT idempotency_key_claim(for_merchant_id, for_key, for_method, for_path,
                                 for_fingerprint, for_charge_id, for_refund_id, ttl_ms,
                                 deadline, age_ms, may_insert, NULL)
$$;

-- Every read sees the claiming request too (a view may gain columns at its end).
CREATE OR REPLACE VIEW idempotency_key_reads AS
SELECT merchant_id, key, status, request_method, request_path, fingerprint,
       charge_id, refund_id, response_status, response_content_type,
       response_location, response_body, created_at, locked_at, expires_at,
       completed_at,
       (extract(epoch from expires_at - statement_timestamp()) * 1000)::float8 AS remaining_ms,
       request_id
  FROM idempotency_keys;
