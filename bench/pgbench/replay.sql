-- A replay of one of the completed keys seed-1 .. seed-NSEED: the plain read
-- of a key that oncepay runs for a replay when its cache misses
-- (crates/oncepay-core/src/idempotency/store.rs::find; the service sends several requests' keys
-- in one statement, store.rs::find_many, see src/speed/reads.rs).
-- The merchant comes from the in-process cache (src/speed/cache.rs), so there is no
-- authentication statement; a cache hit runs no statement at all.
\set r random(1, :nseed)
SELECT key, status, request_method, request_path, fingerprint, charge_id,
    refund_id, response_status, response_content_type, response_location, response_body, created_at, expires_at
  FROM idempotency_keys
 WHERE merchant_id = :merchant AND key = 'seed-' || :r::bigint
   AND expires_at > now();
