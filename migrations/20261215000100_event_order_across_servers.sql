-- The events' order, (txid, seq), kept across a move to another Postgres
-- server. A transaction id is a per-server counter: after pg_dump/pg_restore
-- onto a new cluster (or a logical replication cutover, or a blue/green major
-- upgrade) the new server hands out ids far below those of the restored
-- events, so new events would sort before old ones, behind the relay's
-- recorded position and behind every cursor a client of the events list
-- holds, and would never be published or listed.
--
-- So `events.txid` is the server's transaction id plus an offset of that
-- server's own, chosen once, the first time the server writes or reads
-- events, so that every id it hands out from then on sorts after every
-- event it was given. On the server the events were first written on (and
-- on its physical standbys, which share its identifier and its counter) the
-- offset is 0, or a little more if a transaction older than the newest event
-- was open when it was chosen. See docs/broker.md#a-new-postgres-server.

-- One row per server that has written or read events: its offset.
CREATE TABLE event_clocks (
    system_identifier bigint      PRIMARY KEY,
    txid_offset       bigint      NOT NULL CHECK (txid_offset >= 0),
    adopted_at        timestamptz NOT NULL DEFAULT now()
);

-- This server's offset, adopted when it has none: the smallest that puts
-- its oldest running transaction id after every event and relay position
-- it holds. Remembered for the session (a session stays on its server).
-- Each session checks, once, that no event or position lies beyond the ids
-- the server hands out: one that does was copied in from another server
-- after this one chose its offset (migrations run on an empty database,
-- then the data restored or replicated into it), and new events would sort
-- before it. That is an error, never a silent reorder, until an operator
-- chooses the offset again (event_txid_readopt) with every writer stopped.
CREATE FUNCTION event_txid_offset() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    cached text := current_setting('oncepay.event_txid_offset', true);
    server bigint;
    highest bigint;
    found_offset bigint;
    next_id bigint;
BEGIN
    IF cached IS NOT NULL AND cached <> '' THEN
        RETURN cached::bigint;
    END IF;
    SELECT system_identifier INTO server FROM pg_control_system();
    highest := greatest((SELECT max(txid) FROM events), (SELECT max(txid) FROM relay_positions));
    SELECT txid_offset INTO found_offset FROM event_clocks WHERE system_identifier = server;
    IF found_offset IS NULL THEN
        -- Every transaction still to write an event has an id at or above
        -- the snapshot's xmin, so that is what the offset lifts.
        INSERT INTO event_clocks AS c (system_identifier, txid_offset)
        SELECT server, greatest(0, coalesce(highest, 0) + 1
                                   - pg_snapshot_xmin(pg_current_snapshot())::text::bigint)
        ON CONFLICT (system_identifier) DO UPDATE SET txid_offset = c.txid_offset
        RETURNING txid_offset INTO found_offset;
    END IF;
    next_id := pg_snapshot_xmax(pg_current_snapshot())::text::bigint + found_offset;
    IF highest >= next_id THEN
        RAISE EXCEPTION 'events hold transaction ids up to %, beyond the % this server hands out next: they were copied in from another server after this one chose its offset', highest, next_id
            USING HINT = 'stop every process that writes events, run SELECT event_txid_readopt(), start them again (docs/broker.md#a-new-postgres-server)';
    END IF;
    PERFORM set_config('oncepay.event_txid_offset', found_offset::text, false);
    RETURN found_offset;
END
$$;

-- Chooses this server's offset again, after events were copied in from
-- another server once it had chosen one. Only with every writer stopped: a
-- session that still holds the old offset would write events below the new
-- one's.
CREATE FUNCTION event_txid_readopt() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    DELETE FROM event_clocks
     WHERE system_identifier = (SELECT system_identifier FROM pg_control_system());
    PERFORM set_config('oncepay.event_txid_offset', '', false);
    RETURN event_txid_offset();
END
$$;

ALTER TABLE events ALTER COLUMN txid
    SET DEFAULT pg_current_xact_id()::text::bigint + event_txid_offset();

-- The server these events were written on keeps them where they are.
SELECT event_txid_offset();
