-- A partial capture makes no refund, as at Stripe since API version
-- 2025-03-31.basil: what the capture did not take is released, and the
-- charge's `amount_refunded` counts only its refunds (the amounts reserved
-- by those pending or succeeded), never the part left uncaptured. A refund
-- of a charge captured in part is bounded by what the capture took.
--
-- A charge captured in part before this counted its uncaptured part as
-- refunded; it now counts its refunds alone. The statement is idempotent:
-- run again after a rolling upgrade, it also sets right a capture that an
-- instance of the version before settled meanwhile. See docs/decisions.md
-- ("A partial capture refunds nothing").
UPDATE charges c
   SET amount_refunded = (SELECT coalesce(sum(r.amount), 0)
                            FROM refunds r
                           WHERE r.charge_id = c.id AND r.status IN ('pending', 'succeeded'))
 WHERE c.captured_at IS NOT NULL AND c.capture_amount < c.amount;
