-- A new charge with a fresh Idempotency-Key: the statements oncepay runs on
-- its own database for POST /v1/charges (crates/oncepay-core/src/idempotency/store.rs::claim_with_charge,
-- crates/oncepay-core/src/charges/store.rs::settle_and_complete), each its own implicit
-- transaction. Between the two, the gateway records the payment on its own
-- database (gateway.sql), reached over HTTP. It is minimum.sql with the one
-- thing the service adds: the claim's statement also reads the key (the
-- `existing` CTE), which is how a replay that misses the cache is answered
-- with no second statement while retries are rare (while they are common,
-- the service reads keys first, in batches: src/idempotency/reads.rs). Authentication comes from the in-process cache
-- (src/cache.rs): no statement. Variables come from scripts/bench (-D).
\set r random(1, 999999999999999)
-- (a) Read the key; claim it if free (or completed and expired) and write
-- the pending charge only when the claim returned a row.
WITH existing AS (
     SELECT key, status, request_method, request_path, fingerprint, charge_id, refund_id,
            response_status, response_content_type, response_location, response_body,
            created_at, expires_at,
            (extract(epoch from expires_at - clock_timestamp()) * 1000)::float8 AS remaining_ms
       FROM idempotency_keys
      WHERE merchant_id = :merchant AND key = 'pgb-' || :client_id::int || '-' || :r::bigint),
claimed AS (
     INSERT INTO idempotency_keys
         (merchant_id, key, status, request_method, request_path, fingerprint, charge_id,
          created_at, locked_at, expires_at)
     SELECT :merchant, 'pgb-' || :client_id::int || '-' || :r::bigint, 'processing', 'POST', '/v1/charges', :fp,
            'ch_pgb' || :client_id::int || 'x' || :r::bigint,
            now(), now(), now() + :ttl::float8 * interval '1 millisecond'
      WHERE NOT EXISTS (SELECT 1 FROM existing WHERE status = 'processing' OR expires_at > now())
     ON CONFLICT (merchant_id, key) DO UPDATE SET
         status = 'processing',
         request_method = EXCLUDED.request_method,
         request_path = EXCLUDED.request_path,
         fingerprint = EXCLUDED.fingerprint,
         charge_id = EXCLUDED.charge_id,
         refund_id = NULL,
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
     RETURNING xmax <> 0 AS took_over),
charge AS (
     INSERT INTO charges (id, merchant_id, amount, currency, source, description, metadata, status)
     SELECT 'ch_pgb' || :client_id::int || 'x' || :r::bigint, :merchant, 2000, 'usd', 'tok_visa', NULL,
            '{}'::text::jsonb, 'pending'
       FROM claimed
     RETURNING created_at)
SELECT (SELECT took_over FROM claimed) AS took_over,
       (SELECT created_at FROM charge) AS charge_created_at,
       e.*
  FROM (SELECT 1) AS one LEFT JOIN existing e ON true;
-- (c) Only the statement that moves the charge out of pending completes
-- the key and writes the event, with a delivery to every endpoint that
-- wants it (the benchmark's merchant has none).
WITH settled AS (
     UPDATE charges SET status = 'succeeded', failure_code = NULL, failure_message = NULL
      WHERE id = 'ch_pgb' || :client_id::int || 'x' || :r::bigint AND status = 'pending'
      RETURNING id, merchant_id),
completed AS (
     UPDATE idempotency_keys k
        SET status = 'completed', response_status = 201, response_content_type = 'application/json',
            response_location = '/v1/charges/' || settled.id, response_body = :body::bytea,
            completed_at = now(), locked_at = NULL,
            expires_at = greatest(k.expires_at, now() + :ttl::float8 * interval '1 millisecond')
       FROM settled
      WHERE k.charge_id = settled.id AND k.status = 'processing'
      RETURNING k.key),
written AS (
     INSERT INTO events (id, merchant_id, type, object_id, data, request_id, idempotency_key)
     SELECT 'evt_' || lpad(:client_id::text, 4, '0') || lpad(:r::text, 20, '0'), settled.merchant_id,
            'charge.succeeded', settled.id, :body::json,
            'req-' || :client_id::int || '-' || :r::bigint, (SELECT key FROM completed)
       FROM settled
     RETURNING seq, type),
delivered AS (
     INSERT INTO webhook_deliveries (event_seq, endpoint_id)
     SELECT written.seq, w.id
       FROM written
       JOIN webhook_endpoints w
         ON w.merchant_id = :merchant AND w.status = 'enabled'
        AND (written.type = ANY (w.enabled_events) OR '*' = ANY (w.enabled_events)))
SELECT settled.id, (SELECT key FROM completed) AS key FROM settled;
