-- The floor for a replay (the replay target): one prepared primary-key
-- lookup of a completed key, nothing else.
\set r random(1, :nseed)
SELECT key, status, request_method, request_path, fingerprint, charge_id,
    refund_id, response_status, response_content_type, response_location, response_body, created_at, expires_at
  FROM idempotency_keys WHERE merchant_id = :merchant AND key = 'seed-' || :r::bigint;
