-- The details a charge carries besides its payment, which its create takes
-- and its update changes: where its receipt goes, what the customer's
-- statement shows, where the goods ship, the group its transfers share, and
-- what the merchant reported of its fraud. Webhook endpoints get metadata
-- of their own, and updates their events.

ALTER TABLE charges
    ADD COLUMN receipt_email               text CHECK (length(receipt_email) <= 512),
    ADD COLUMN statement_descriptor        text CHECK (length(statement_descriptor) <= 22),
    ADD COLUMN statement_descriptor_suffix text CHECK (length(statement_descriptor_suffix) <= 22),
    -- Stripe's shipping object: `name`, `address`, `phone`, `carrier`,
    -- `tracking_number`; NULL when none was given.
    ADD COLUMN shipping                    jsonb CHECK (jsonb_typeof(shipping) = 'object'),
    ADD COLUMN transfer_group              text CHECK (length(transfer_group) <= 5000),
    -- `{}`, or `{"user_report": "fraudulent" | "safe"}` once the merchant reported it.
    ADD COLUMN fraud_details               jsonb NOT NULL DEFAULT '{}'::jsonb
                                           CHECK (jsonb_typeof(fraud_details) = 'object');

ALTER TABLE webhook_endpoints
    ADD COLUMN metadata jsonb NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(metadata) = 'object');

-- An update writes `charge.updated` or `refund.updated`, in its transaction,
-- like every other change.
ALTER TABLE events
    DROP CONSTRAINT events_type_check,
    ADD CONSTRAINT events_type_check
        CHECK (type IN ('charge.succeeded', 'charge.failed', 'charge.refunded', 'charge.updated',
                        'refund.succeeded', 'refund.failed', 'refund.updated'));
