-- A replay of one of the completed keys seed-1 .. seed-NSEED.
-- The statements oncepay runs for a replay (src/http/auth.rs,
-- src/http/idempotent.rs::claim_or_answer, src/idempotency/store.rs::claim):
-- authentication, then a claim that conflicts (and locks the row), the read of
-- the stored key, and the rollback.
\set r random(1, :nseed)
SELECT id, name FROM merchants WHERE api_key_hash = :keyhash;
BEGIN;
INSERT INTO idempotency_keys
    (merchant_id, key, status, request_method, request_path, fingerprint, charge_id, refund_id, created_at, locked_at, expires_at)
VALUES (:merchant, 'seed-' || :r::bigint, 'processing', 'POST', '/v1/charges', :fp,
        'ch_pgbreplay' || :client_id::int, NULL,
        now(), now(), now() + :ttl::float8 * interval '1 millisecond')
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
    completed_at = NULL
WHERE idempotency_keys.expires_at <= now()
  AND idempotency_keys.status = 'completed'
RETURNING xmax <> 0 AS took_over;
SELECT key, status, request_method, request_path, fingerprint, charge_id,
    refund_id, response_status, response_content_type, response_location, response_body, created_at, expires_at
  FROM idempotency_keys WHERE merchant_id = :merchant AND key = 'seed-' || :r::bigint;
ROLLBACK;
