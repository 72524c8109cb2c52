-- A new charge with a fresh Idempotency-Key: the statements oncepay runs for
-- POST /v1/charges, in its transactions (src/http/auth.rs, src/idempotency/store.rs::claim,
-- src/charges/store.rs::insert_pending, src/processor/simulated.rs::authorize,
-- src/charges/settle.rs::settle). Variables come from scripts/bench (-D).
-- A unique key per transaction: the client id and a random 50-bit number.
\set r random(1, 999999999999999)
-- Authentication: the merchant comes from the in-process cache (src/cache.rs),
-- so there is no statement for it. A fresh key first gets the fast-path read
-- of the key (src/idempotency/store.rs::find), which finds nothing.
SELECT 1 FROM idempotency_keys
 WHERE merchant_id = :merchant AND key = 'pgb-' || :client_id::int || '-' || :r::bigint
   AND expires_at > now();
-- Step 2: claim the key and write the pending charge, one transaction.
BEGIN;
INSERT INTO idempotency_keys
    (merchant_id, key, status, request_method, request_path, fingerprint, charge_id, refund_id, created_at, locked_at, expires_at)
VALUES (:merchant, 'pgb-' || :client_id::int || '-' || :r::bigint, 'processing', 'POST', '/v1/charges', :fp,
        'ch_pgb' || :client_id::int || 'x' || :r::bigint, NULL,
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
INSERT INTO charges (id, merchant_id, amount, currency, source, description, metadata, status)
VALUES ('ch_pgb' || :client_id::int || 'x' || :r::bigint, :merchant, 2000, 'usd', 'tok_visa', NULL, '{}'::jsonb, 'pending');
COMMIT;
-- Step 3: the simulated processor records the payment in its own transaction
-- (its read-back runs only when the insert conflicts, never for a new charge).
-- ('auth:' || 'ch...': pgbench would read ':ch...' inside one literal as a variable.)
INSERT INTO processor_operations
    (processor_key, kind, outcome, amount, currency, source, decline_code)
VALUES ('auth:' || 'ch_pgb' || :client_id::int || 'x' || :r::bigint, 'authorization', 'succeeded', 2000, 'usd', 'tok_visa', NULL)
ON CONFLICT (processor_key) DO NOTHING
RETURNING outcome, decline_code;
-- Step 4: settle the charge and save the response on the key, one transaction.
BEGIN;
UPDATE charges SET status = 'succeeded', failure_code = NULL, failure_message = NULL
 WHERE id = 'ch_pgb' || :client_id::int || 'x' || :r::bigint AND status = 'pending'
 RETURNING id, amount, currency, source, description, metadata, status,
    failure_code, failure_message, amount_refunded, created_at;
UPDATE idempotency_keys
   SET status = 'completed', response_status = 201, response_content_type = 'application/json',
       response_location = '/v1/charges/ch_pgb' || :client_id::int || 'x' || :r::bigint,
       response_body = :body::bytea, completed_at = now(), locked_at = NULL
 WHERE charge_id = 'ch_pgb' || :client_id::int || 'x' || :r::bigint AND status = 'processing';
COMMIT;
