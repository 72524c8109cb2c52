-- The least SQL any design of a new charge needs on oncepay's database that
-- claims its key and settles the charge: two statements, each its own
-- implicit transaction (no BEGIN or COMMIT), so two round trips and two
-- commits. The processor's record is another system's (the gateway's, on
-- its own database): gateway.sql, measured apart and added to this one with
-- the bare HTTP hop to make the anchor of the new-charge rows (see
-- docs/performance.md). Variables come from scripts/bench (-D).
--   (a) claim the key and write the pending charge, one statement;
--   (c) settle the charge, complete its key with the saved answer and write
--       its event with the webhook deliveries, one statement.
-- (b), between them, is the gateway's record of the payment, reached over
-- HTTP. The client knows the answer before (c): the charge's fields are its
-- own, so the saved body and the event's data are sent with the statement
-- (here the probe charge's body, as in new_charge.sql). The fast-path read
-- of new_charge.sql is not needed: the claim finds a taken key itself.
\set r random(1, 999999999999999)
-- (a) The claim takes a fresh key, or an expired completed one; the charge
-- is written only when it did (a data-modifying CTE always runs to the end).
WITH claimed AS (
     INSERT INTO idempotency_keys
         (merchant_id, key, status, request_method, request_path, fingerprint, charge_id,
          refund_id, created_at, locked_at, expires_at)
     VALUES (:merchant, 'pgm-' || :client_id::int || '-' || :r::bigint, 'processing', 'POST', '/v1/charges', :fp,
             'ch_pgm' || :client_id::int || 'x' || :r::bigint, NULL,
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
     RETURNING charge_id, xmax <> 0 AS took_over),
charge AS (
     INSERT INTO charges (id, merchant_id, amount, currency, source, description, metadata, status)
     SELECT claimed.charge_id, :merchant, 2000, 'usd', 'tok_visa', NULL, '{}'::jsonb, 'pending'
       FROM claimed
     RETURNING created_at)
SELECT claimed.took_over, charge.created_at FROM claimed, charge;
-- (c) Only the statement that moves the charge out of pending completes
-- the key and writes the event, with a delivery to every endpoint that
-- wants it (the benchmark's merchant has none).
WITH settled AS (
     UPDATE charges SET status = 'succeeded', failure_code = NULL, failure_message = NULL
      WHERE id = 'ch_pgm' || :client_id::int || 'x' || :r::bigint AND status = 'pending'
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
