-- A merchant's key can be rolled: `api_key_hash` is the key in use, and the
-- key it replaced stays valid, beside it, until `previous_key_expires_at`.
-- At most two live keys per merchant, by construction. Only SHA-256 hashes
-- are stored, as for the key in use. Authentication looks the key in use up
-- first (its unique index), then, only when that finds nothing, a previous
-- key (this unique index), so a request costs one index lookup as before.
ALTER TABLE merchants
    ADD COLUMN previous_key_hash       bytea UNIQUE CHECK (length(previous_key_hash) = 32),
    ADD COLUMN previous_key_expires_at timestamptz,
    ADD CONSTRAINT merchants_previous_key_has_an_expiry
        CHECK ((previous_key_hash IS NULL) = (previous_key_expires_at IS NULL));
