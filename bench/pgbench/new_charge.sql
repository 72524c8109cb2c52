-- A new charge with a fresh Idempotency-Key: the statements oncepay runs for
-- POST /v1/charges, in its transactions, in order. Variables come from
-- scripts/bench (-D). Where each statement comes from:
--   the fast-path read          src/idempotency/store.rs::find
--   the claim                   src/idempotency/store.rs::claim
--   the pending charge          src/charges/store.rs::insert_pending
--   the processor's record      src/processor/simulated.rs::authorize
--   the settle                  src/charges/store.rs::settle_pending
--   the key's saved answer      src/idempotency/store.rs::complete_for
--   the event and its webhook deliveries  src/events/store.rs::insert
-- (src/charges/settle.rs puts the last three in one transaction.) No
-- authentication statement: the merchant comes from the in-process cache
-- (src/cache.rs). scripts/bench checks with pg_stat_statements that this
-- script runs as many statements per transaction as the service runs per
-- request, and says so when they differ.
-- A unique key per transaction: the client id and a random 50-bit number.
\set r random(1, 999999999999999)
-- Step 1: the fast-path read of the key, which finds nothing.
SELECT key, status, request_method, request_path, fingerprint,
       charge_id, refund_id, response_status, response_content_type,
       response_location, response_body, created_at, expires_at,
       (extract(epoch from expires_at - clock_timestamp()) * 1000)::float8 AS remaining_ms
  FROM idempotency_keys
 WHERE merchant_id = :merchant AND key = 'pgb-' || :client_id::int || '-' || :r::bigint
   AND (expires_at > now() OR status = 'processing');
-- Step 2: claim the key and write the pending charge, one transaction.
BEGIN;
INSERT INTO idempotency_keys
    (merchant_id, key, status, request_method, request_path, fingerprint, charge_id,
     refund_id, created_at, locked_at, expires_at)
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
-- Step 4: settle the charge, save the answer on its key and write its event
-- with the webhook deliveries, one transaction. The event's data is the
-- probe charge's body, of the size a real charge object has; the merchant
-- of the benchmark has no webhook endpoint, so the fan-out finds none.
BEGIN;
UPDATE charges SET status = 'succeeded', failure_code = NULL, failure_message = NULL
 WHERE id = 'ch_pgb' || :client_id::int || 'x' || :r::bigint AND status = 'pending'
 RETURNING id, merchant_id, amount, currency, source, description, metadata, status,
    failure_code, failure_message, amount_refunded, created_at;
UPDATE idempotency_keys
   SET status = 'completed', response_status = 201, response_content_type = 'application/json',
       response_location = '/v1/charges/ch_pgb' || :client_id::int || 'x' || :r::bigint,
       response_body = :body::bytea, completed_at = now(), locked_at = NULL,
       expires_at = greatest(expires_at, now() + :ttl::float8 * interval '1 millisecond')
 WHERE charge_id = 'ch_pgb' || :client_id::int || 'x' || :r::bigint AND status = 'processing'
 RETURNING key;
WITH written AS (
     INSERT INTO events (id, merchant_id, type, object_id, data, request_id, idempotency_key)
     SELECT e.id, :merchant, e.type, e.object_id, e.data::json,
            'req-' || :client_id::int || '-' || :r::bigint, 'pgb-' || :client_id::int || '-' || :r::bigint
       FROM unnest(ARRAY['evt_' || lpad(:client_id::text, 4, '0') || lpad(:r::text, 20, '0')]::text[],
                   ARRAY['charge.succeeded']::text[],
                   ARRAY['ch_pgb' || :client_id::int || 'x' || :r::bigint]::text[],
                   ARRAY[:body]::text[])
            WITH ORDINALITY AS e(id, type, object_id, data, n)
      ORDER BY e.n
     RETURNING seq, type)
INSERT INTO webhook_deliveries (event_seq, endpoint_id)
SELECT written.seq, w.id
  FROM written
  JOIN webhook_endpoints w
    ON w.merchant_id = :merchant AND w.status = 'enabled'
   AND (written.type = ANY (w.enabled_events) OR '*' = ANY (w.enabled_events))
 ORDER BY written.seq, w.id;
COMMIT;
