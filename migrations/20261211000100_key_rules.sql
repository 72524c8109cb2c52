-- The rules of an idempotency key's life, each written once here and used by
-- every statement that needs it (crates/oncepay-core/src/idempotency/store.rs,
-- and the charges' settle). Only functions and a view: no table or row changes.
-- The predicates are STABLE SQL functions, which Postgres inlines into the
-- calling statement, so its plan keeps its indexes.

-- Whether a key has expired: only a `completed` key past its `expires_at`. A
-- `processing` key never expires, however old: its operation may still be at
-- work, or waiting to be recovered, and its answer is kept for a full TTL once
-- it exists. An expired key counts as never seen: reads do not find it, a claim
-- may take it over, and the sweeper deletes it.
CREATE FUNCTION idempotency_key_expired(status text, expires_at timestamptz)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT expires_at <= now() AND status = 'completed'
$$;

-- Whether a claim may take over an existing key: only an expired one whose
-- answer was saved before the claiming request arrived, `age_ms` ago. An answer
-- saved since may be the answer to this very operation, made by its retry: it
-- is replayed, never replaced. Both sides of the comparison are readings of
-- the database's clock (see `Claim::age_ms` in the store).
CREATE FUNCTION idempotency_key_takeover(
    status text, expires_at timestamptz, completed_at timestamptz, age_ms float8
) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT idempotency_key_expired(status, expires_at)
       AND completed_at < statement_timestamp() - age_ms * interval '1 millisecond'
$$;

-- Claims a key for a request, as one statement: inserts it as `processing`,
-- or takes over the existing row where `idempotency_key_takeover` allows.
-- Returns one row, whether it took a row over (`xmax <> 0`: the row was
-- updated, not inserted), or none when nothing was claimed. Nothing is
-- claimed when `may_insert` is false, nor when the statement reached the
-- database after `deadline` (`statement_timestamp()` is the calling
-- statement's arrival): the request may have been answered and retried by
-- then. A row that is not taken over is still locked by the conflict, which
-- the caller relies on (or avoids, through `may_insert`). PL/pgSQL, so each
-- connection plans the statement once.
CREATE FUNCTION idempotency_key_claim(
    for_merchant_id uuid, for_key text, for_method text, for_path text,
    for_fingerprint bytea, for_charge_id text, for_refund_id text, ttl_ms float8,
    deadline timestamptz, age_ms float8, may_insert boolean
) RETURNS SETOF boolean
LANGUAGE plpgsql ROWS 1
AS $$
BEGIN
    RETURN QUERY
    INSERT INTO idempotency_keys AS k
           (merchant_id, key, status, request_method, request_path, fingerprint,
            charge_id, refund_id, created_at, locked_at, expires_at)
    SELECT for_merchant_id, for_key, 'processing', for_method, for_path, for_fingerprint,
           for_charge_id, for_refund_id,
           now(), now(), now() + ttl_ms * interval '1 millisecond'
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
        completed_at = NULL
    WHERE idempotency_key_takeover(k.status, k.expires_at, k.completed_at, age_ms)
    RETURNING k.xmax <> 0;
END
$$;

-- Completes the `processing` key that guards the charge `for_charge_id`, the
-- refund `for_refund_id`, or that `for_merchant_id` holds as `for_key` (the
-- others NULL), with the saved response; returns the key it completed. The
-- answer stays replayable for a full `ttl_ms` from the moment it exists:
-- `expires_at` moves to at least now() + ttl. Without that, an operation
-- settled late (recovered after an outage longer than the TTL) would complete
-- an already expired key, and the next retry would take it over and charge
-- again. A key that is not `processing` any more (someone else completed it)
-- is left alone. PL/pgSQL, so each connection plans the statement once; the
-- key is found by one of three index lookups, so that plan, made for any of
-- the three ways to name it, still reads one row rather than the table.
CREATE FUNCTION idempotency_key_complete(
    for_charge_id text, for_refund_id text, for_merchant_id uuid, for_key text,
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
               SELECT for_merchant_id, for_key WHERE for_key IS NOT NULL
               LIMIT 1)
    RETURNING k.key;
END
$$;

-- A key as every read of it sees it: all its columns, and `remaining_ms`, the
-- milliseconds from the read to `expires_at` by the database's clock. It is
-- measured from `statement_timestamp()`, the arrival of the reading
-- statement, not from `now()`: inside a transaction `now()` is the
-- transaction's start, earlier than the instant the reader took before it
-- sent the read, which would stretch the deadline it derives. (It is a stable
-- function, unlike `clock_timestamp()`, so Postgres folds the view into each
-- query that reads it and keeps that query's index scans.)
CREATE VIEW idempotency_key_reads AS
SELECT merchant_id, key, status, request_method, request_path, fingerprint,
       charge_id, refund_id, response_status, response_content_type,
       response_location, response_body, created_at, locked_at, expires_at,
       completed_at,
       (extract(epoch from expires_at - statement_timestamp()) * 1000)::float8 AS remaining_ms
  FROM idempotency_keys;
