-- A workshop run belongs to one merchant: the merchant that set up its
-- first receiver. The receivers' table is keyed by (run, mode), so without
-- this another merchant could set up the other mode of someone's run and
-- take that run's deliveries in that mode. One row per run decides, with
-- its primary key, who the run belongs to; every receiver of the run must
-- be that merchant's.
CREATE TABLE demo_receiver_runs (
    run         text        PRIMARY KEY CHECK (length(run) BETWEEN 1 AND 200),
    merchant_id uuid        NOT NULL REFERENCES merchants (id),
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (run, merchant_id)
);

-- The runs set up so far, each given to the merchant of its first receiver.
INSERT INTO demo_receiver_runs (run, merchant_id, created_at)
SELECT DISTINCT ON (run) run, merchant_id, created_at
  FROM demo_receivers
 ORDER BY run, created_at, mode;

-- NOT VALID: receivers set up before this migration by a merchant other than
-- their run's stay as they are (no row is deleted); every receiver set up
-- from now on is checked.
ALTER TABLE demo_receivers
    ADD CONSTRAINT demo_receivers_run_owner_fkey
    FOREIGN KEY (run, merchant_id) REFERENCES demo_receiver_runs (run, merchant_id)
    NOT VALID;
