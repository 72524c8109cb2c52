-- The gateway's record of a new payment, on the gateway's own database (the
-- `operations` ledger): the one statement `oncepay processor` runs for an
-- authorization under a fresh key (crates/card-gateway/src/store.rs::insert_authorization),
-- its own implicit transaction. A key that holds an operation already would
-- cost one more statement, the read of what stands; a new charge's key never
-- does. The least any ledger that records each payment once can do, and the
-- gateway's part of the new-charge anchor. Variables come from scripts/bench (-D);
-- `account` is the service's account at the gateway.
\set r random(1, 999999999999999)
INSERT INTO operations (account, key, kind, outcome, amount, currency, source, decline_code)
VALUES (:account, 'auth:' || 'ch_pgg' || :client_id::int || 'x' || :r::bigint, 'authorization',
        'succeeded', 2000, 'usd', 'tok_visa', NULL)
ON CONFLICT (account, key) DO NOTHING
RETURNING key, kind, outcome, amount, currency, source, decline_code, payment_key,
          created, 0::bigint AS refunds, 0::bigint AS amount_refunded;
