-- Who may call the gateway, and whose each row of the ledger is. An account
-- per caller (one oncepay deployment, say), with secret keys of its own; a
-- key's secret is never stored, only its SHA-256. Every operation belongs
-- to one account, and a key names an operation within its account only:
-- two accounts may use the same idempotency key without meeting.
CREATE TABLE accounts (
    id      text        PRIMARY KEY,
    name    text        NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 200),
    created timestamptz NOT NULL DEFAULT now()
);

-- A secret is `gwsk_<id>_<random>`: the id finds the row, and the hash of
-- the whole secret is compared in constant time.
CREATE TABLE api_keys (
    id      text        PRIMARY KEY,
    account text        NOT NULL REFERENCES accounts (id),
    hash    bytea       NOT NULL CHECK (length(hash) = 32),
    created timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX api_keys_account_idx ON api_keys (account);

-- The rows written before there were accounts belong to an account of
-- their own that holds no key: nobody reads or refunds them any more.
INSERT INTO accounts (id, name) VALUES ('acct_before_accounts', 'the ledger before accounts');

ALTER TABLE operations ADD COLUMN account text REFERENCES accounts (id);
UPDATE operations SET account = 'acct_before_accounts';
ALTER TABLE operations ALTER COLUMN account SET NOT NULL;

ALTER TABLE operations DROP CONSTRAINT operations_payment_key_fkey;
ALTER TABLE operations DROP CONSTRAINT operations_pkey;
ALTER TABLE operations ADD PRIMARY KEY (account, key);
-- A refund gives money back from a payment of its own account only.
ALTER TABLE operations ADD CONSTRAINT operations_payment_fkey
    FOREIGN KEY (account, payment_key) REFERENCES operations (account, key);

DROP INDEX operations_payment_key_idx;
CREATE INDEX operations_payment_key_idx ON operations (account, payment_key)
    WHERE payment_key IS NOT NULL;

DROP INDEX operations_created_key_idx;
CREATE INDEX operations_created_key_idx ON operations (account, created, key);
