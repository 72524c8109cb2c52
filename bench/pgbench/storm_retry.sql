-- A retry of one of the NHOT hot keys pghot-1 .. pghot-NHOT (completed): 9 in
-- 10 transactions of the retry storm (the other one is new_charge.sql). The
-- statement oncepay runs for a replay when its cache misses
-- (crates/oncepay-core/src/idempotency/store.rs::find); no authentication statement, as
-- the merchant is cached (src/speed/cache.rs).
\set r random(1, :nhot)
SELECT key, status, request_method, request_path, fingerprint, charge_id,
    refund_id, response_status, response_content_type, response_location, response_body, created_at, expires_at
  FROM idempotency_keys
 WHERE merchant_id = :merchant AND key = 'pghot-' || :r::bigint
   AND expires_at > now();
