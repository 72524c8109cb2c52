-- Reconciliation runs of the periodic job in `serve`: one row per run that
-- compared oncepay's charges and refunds with the processor's ledger. The
-- instance holding the reconciliation lock reads the latest `started_at`
-- to decide whether a run is due, so the fleet runs about once per
-- RECONCILE_INTERVAL, whichever instance it falls to.
CREATE TABLE reconcile_runs (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    -- The window compared: records created in [window_from, window_until).
    window_from  timestamptz NOT NULL,
    window_until timestamptz NOT NULL,
    -- Differences found, in all and by kind ({"orphan_payment": 1, ...}).
    differences integer     NOT NULL CHECK (differences >= 0),
    by_kind     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    CHECK (finished_at >= started_at),
    CHECK (window_until > window_from)
);

CREATE INDEX reconcile_runs_started_idx ON reconcile_runs (started_at DESC);
