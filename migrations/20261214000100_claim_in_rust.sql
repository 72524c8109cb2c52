-- The claim moves into the code that makes it: one `INSERT ... ON CONFLICT`
-- written in Rust where it is used (crates/oncepay-core/src/operation/claim.rs),
-- checked against this schema by sqlx. What stays here are the small rules
-- every statement shares, each written once: `idempotency_key_expired` and
-- `idempotency_key_takeover` (20261211000100_key_rules.sql), the new
-- `idempotency_key_stale` below, and `idempotency_key_complete`
-- (20261213000500_capture.sql). No table or row changes.
--
-- An instance of the previous release calls the PL/pgSQL claim dropped here:
-- its claims fail (a 500, nothing claimed, nothing written) until it is
-- replaced, so a fleet is upgraded by replacing its instances, not by running
-- both releases side by side for long (docs/decisions.md).
DROP FUNCTION idempotency_key_claim(uuid, text, text, text, bytea, text, text, float8,
                                    timestamptz, float8, boolean);
DROP FUNCTION idempotency_key_claim(uuid, text, text, text, bytea, text, text, float8,
                                    timestamptz, float8, boolean, text);
DROP FUNCTION idempotency_key_claim(uuid, text, text, text, bytea, text, text, float8,
                                    timestamptz, float8, boolean, text, text);
-- The completion as instances before captures called it; the one that names a
-- capture stays, the rule's only version.
DROP FUNCTION idempotency_key_complete(text, text, uuid, text, smallint, text, text, bytea,
                                       float8);

-- Whether a key is stale: still `processing` after `timeout_ms` since its
-- holder took it (or a sweeper last leased it). Its request may be gone; a
-- retry or the sweeper may lease it and settle its record. Used by the read
-- after a claim, by waits, and by both leases.
CREATE FUNCTION idempotency_key_stale(status text, locked_at timestamptz, timeout_ms float8)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT status = 'processing' AND locked_at < now() - timeout_ms * interval '1 millisecond'
$$;
