-- A new charge with a fresh Idempotency-Key: the statements oncepay runs on
-- its own database for POST /v1/charges (crates/oncepay-core/src/operation/claim.rs::claim,
-- crates/oncepay-core/src/charges/store.rs::settle_and_complete), each its own implicit
-- transaction. Between the two, the gateway records the payment on its own
-- database (gateway.sql), reached over HTTP. It is minimum.sql with what the
-- service adds: the takeover rule, the deadline, and the pending charge
-- passed as one jsonb value. A key found taken is read by a second
-- statement, which a new key never needs (while retries are common, the
-- service reads keys before the core instead, in batches: src/speed/reads.rs).
-- Authentication comes from the in-process cache (src/speed/cache.rs): no
-- statement. Variables come from scripts/bench (-D).
\set r random(1, 999999999999999)
-- (a) The claim: the key, and the pending charge exactly when the key is claimed.
WITH claimed AS (
     INSERT INTO idempotency_keys AS k
            (merchant_id, key, status, request_method, request_path, fingerprint,
             charge_id, refund_id, capture_of, request_id,
             created_at, locked_at, expires_at)
     SELECT :merchant, 'pgb-' || :client_id::int || '-' || :r::bigint, 'processing', 'POST',
            '/v1/charges', :fp, 'ch_pgb' || :client_id::int || 'x' || :r::bigint, NULL, NULL,
            NULL, now(), now(), now() + :ttl::float8 * interval '1 millisecond'
      WHERE statement_timestamp() < now() + interval '15 seconds'
     ON CONFLICT (merchant_id, key) DO UPDATE
        SET (status, request_method, request_path, fingerprint,
             charge_id, refund_id, capture_of, request_id,
             created_at, locked_at, expires_at, completed_at, response_status,
             response_content_type, response_location, response_body)
          = (EXCLUDED.status, EXCLUDED.request_method, EXCLUDED.request_path,
             EXCLUDED.fingerprint, EXCLUDED.charge_id, EXCLUDED.refund_id,
             EXCLUDED.capture_of, EXCLUDED.request_id, EXCLUDED.created_at,
             EXCLUDED.locked_at, EXCLUDED.expires_at, NULL, NULL, NULL, NULL, NULL)
      WHERE idempotency_key_takeover(k.status, k.expires_at, k.completed_at, 1.0)
     RETURNING k.xmax <> 0 AS took_over),
pending_charge AS (
     INSERT INTO charges (id, merchant_id, amount, currency, source, description,
                          metadata, status, receipt_email, statement_descriptor,
                          statement_descriptor_suffix, shipping, transfer_group,
                          capture_later)
     SELECT c.id, c.merchant_id, c.amount, c.currency, c.source, c.description,
            c.metadata, 'pending', c.receipt_email, c.statement_descriptor,
            c.statement_descriptor_suffix, c.shipping, c.transfer_group,
            c.capture_later
       FROM jsonb_populate_record(NULL::charges, jsonb_build_object(
                'id', 'ch_pgb' || :client_id::int || 'x' || :r::bigint,
                'merchant_id', :merchant::uuid, 'amount', 2000, 'currency', 'usd',
                'source', 'tok_visa', 'description', NULL, 'metadata', '{}'::jsonb,
                'shipping', NULL, 'capture_later', false)) AS c
      WHERE EXISTS (SELECT FROM claimed)
     RETURNING created_at)
SELECT statement_timestamp() < now() + interval '15 seconds' AS in_time,
       (SELECT took_over FROM claimed) AS took_over,
       (SELECT created_at FROM pending_charge) AS charge_created_at;
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
