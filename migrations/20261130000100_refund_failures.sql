-- A refund the processor refuses for good ends `failed`, with the reason,
-- and gives its reservation back on the charge in the same transaction.
ALTER TABLE refunds
    ADD COLUMN failure_reason text,
    ADD CONSTRAINT refunds_failure_reason_check
        CHECK ((status = 'failed') = (failure_reason IS NOT NULL));

-- The simulated processor records a refusal like any other outcome, under
-- the refund's processor key, so a repeated refund call gets the same answer.
ALTER TABLE processor_operations
    DROP CONSTRAINT processor_operations_outcome_check,
    DROP CONSTRAINT processor_operations_refund_check,
    ADD CONSTRAINT processor_operations_outcome_check
        CHECK (outcome IN ('succeeded', 'declined', 'voided', 'refunded', 'refund_failed')),
    ADD CONSTRAINT processor_operations_refund_check
        CHECK ((kind = 'refund') = (outcome IN ('refunded', 'refund_failed'))
               AND (kind = 'refund') = (payment_key IS NOT NULL));
