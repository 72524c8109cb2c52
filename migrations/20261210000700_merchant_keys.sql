-- Every key hash a merchant has held, in use, previous or rolled away, kept
-- for good: a hash names at most one merchant, ever. Its primary key is the
-- rule, so Postgres enforces it atomically: of two statements that give one
-- hash to two merchants at once, the second waits for the first and fails
-- with a unique violation. Authentication still reads `merchants` (its
-- two unique indexes); this table only says whose a hash is, so that a
-- start with a key that was rolled away finds its merchant rather than
-- making a second one.
CREATE TABLE merchant_keys (
    hash        bytea       PRIMARY KEY CHECK (length(hash) = 32),
    merchant_id uuid        NOT NULL REFERENCES merchants (id),
    issued_at   timestamptz NOT NULL DEFAULT now(),
    -- The target of the previous key's foreign key below.
    UNIQUE (hash, merchant_id)
);

INSERT INTO merchant_keys (hash, merchant_id)
SELECT api_key_hash, id FROM merchants;

-- A previous key that another merchant holds in use: a start with a key
-- rolled away made that merchant before this table existed. The key
-- already authenticates as that merchant (the key in use is looked up
-- first), so ending it as a previous key changes no request's outcome.
UPDATE merchants
   SET previous_key_hash = NULL, previous_key_expires_at = NULL
 WHERE previous_key_hash IN (SELECT hash FROM merchant_keys);

INSERT INTO merchant_keys (hash, merchant_id)
SELECT previous_key_hash, id FROM merchants WHERE previous_key_hash IS NOT NULL;

-- A previous key is one the merchant itself held.
ALTER TABLE merchants
    ADD CONSTRAINT merchants_previous_key_is_its_own
        FOREIGN KEY (previous_key_hash, id) REFERENCES merchant_keys (hash, merchant_id);

-- A key in use is a new key: the merchant claims its hash as it gets it,
-- and a hash any merchant ever held fails the claim.
CREATE FUNCTION merchant_keys_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO merchant_keys (hash, merchant_id) VALUES (NEW.api_key_hash, NEW.id);
    RETURN NULL;
END
$$;

CREATE TRIGGER merchants_claim_key_on_insert
    AFTER INSERT ON merchants
    FOR EACH ROW EXECUTE FUNCTION merchant_keys_claim();
CREATE TRIGGER merchants_claim_key_on_roll
    AFTER UPDATE OF api_key_hash ON merchants
    FOR EACH ROW WHEN (NEW.api_key_hash IS DISTINCT FROM OLD.api_key_hash)
    EXECUTE FUNCTION merchant_keys_claim();
