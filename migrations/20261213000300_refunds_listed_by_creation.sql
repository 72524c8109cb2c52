-- The refunds lists (GET /v1/refunds, and a charge's, GET /v1/charges/{id}/refunds)
-- page by (created_at, id), newest first, as the charges list does: each page
-- is one range of one of these indexes. They replace the indexes on
-- merchant_id and charge_id alone, whose look-ups (the balance's sum of a
-- merchant's refunds, a page of charges' refunds, the foreign keys) use their
-- first column as well.

CREATE INDEX refunds_merchant_created_idx ON refunds (merchant_id, created_at DESC, id DESC);
CREATE INDEX refunds_charge_created_idx ON refunds (charge_id, created_at DESC, id DESC);
DROP INDEX refunds_merchant_idx;
DROP INDEX refunds_charge_idx;
