-- The card processor is a system of its own now, with its own database
-- (`oncepay processor`, PROCESSOR_DATABASE_URL); oncepay reaches it only
-- over HTTP, so its ledger no longer lives here. Rows an older version
-- wrote are dropped with the table: see docs/decisions.md for what a
-- deployment with such rows does first.
DROP TABLE processor_operations;
