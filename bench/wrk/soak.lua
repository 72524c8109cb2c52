-- wrk script for scripts/bench's soak: a steady mix of new charges, replays
-- and refunds, each connection waiting BENCH_SOAK_DELAY_MS before each of its
-- requests, so that the rate stays fixed and modest instead of flat out.
-- Settings come from the environment:
--   BENCH_API_KEY       the merchant's secret key
--   BENCH_RUN           a tag unique to this run, so that new keys never repeat
--   BENCH_SOAK_DELAY_MS the pause of a connection before each request
--   BENCH_OUT           where done() appends its result as one JSON line
-- Each thread repeats the cycle new charge, replay, new charge, replay,
-- refund: two new charges, two replays and one refund in five requests.
--   - A new charge has a key of its own, also sent as metadata[soak_key], so
--     that its answer says which key it answers (wrk does not pair answers
--     with requests).
--   - A replay repeats, byte for byte, one of the thread's last REPLAY_WINDOW
--     answered requests (charges and refunds alike), picked at random: many
--     are the key's first replay (a cache miss, then remembered), the others
--     hit the replay cache if it is on.
--   - A refund, with a new key, refunds part of a charge answered earlier,
--     each charge once; with none waiting, a new charge is sent instead.
-- Every charge and refund writes events, which the service delivers to the
-- webhook endpoint scripts/bench registered.
-- A new request must be answered 201, a replay 201 with Idempotent-Replayed;
-- anything else is counted as unexpected, by status.

local api_key = assert(os.getenv("BENCH_API_KEY"), "BENCH_API_KEY is not set")
local run = os.getenv("BENCH_RUN") or tostring(os.time())
local pause = tonumber(os.getenv("BENCH_SOAK_DELAY_MS") or "20")
local out = os.getenv("BENCH_OUT")

local REPLAY_WINDOW = 2000
local CYCLE = { "charge", "replay", "charge", "replay", "refund" }

local threads = {}
function setup(thread)
   table.insert(threads, thread)
   thread:set("tid", #threads)
end

-- Runs in each thread's own Lua state.
function init(args)
   counter, step = 0, 0
   charges, refunds, replays, unexpected = 0, 0, 0, 0
   statuses = {}
   answered = {}      -- ring of answered requests: { path, body, key }
   answered_next = 1
   sent = {}          -- key -> { path, body } until its first answer
   to_refund = {}     -- queue of charge ids answered, not yet refunded
   refund_head, refund_tail = 1, 0
   math.randomseed(tid * 7919 + os.time())
   headers = {
      ["Authorization"] = "Bearer " .. api_key,
      ["Content-Type"] = "application/x-www-form-urlencoded",
   }
end

function delay()
   return pause
end

local function fresh(path, fields)
   counter = counter + 1
   local key = "soak-" .. run .. "-" .. tid .. "-" .. counter
   local body = fields .. "&metadata[soak_key]=" .. key
   sent[key] = { path = path, body = body }
   headers["Idempotency-Key"] = key
   return wrk.format("POST", path, headers, body)
end

local function new_charge()
   return fresh("/v1/charges", "amount=2000&currency=usd&source=tok_visa")
end

function request()
   step = step % #CYCLE + 1
   local kind = CYCLE[step]
   if kind == "replay" and #answered > 0 then
      local r = answered[math.random(#answered)]
      headers["Idempotency-Key"] = r.key
      return wrk.format("POST", r.path, headers, r.body)
   elseif kind == "refund" and refund_head <= refund_tail then
      local charge = to_refund[refund_head]
      to_refund[refund_head] = nil
      refund_head = refund_head + 1
      return fresh("/v1/refunds", "charge=" .. charge .. "&amount=500")
   end
   return new_charge()
end

function response(status, headers, body)
   local replayed = headers["idempotent-replayed"] == "true"
   local key = status == 201 and body:match('"soak_key":"([^"]+)"')
   local original = key and sent[key]
   if status ~= 201 or (replayed and original) or (not replayed and not original) then
      unexpected = unexpected + 1
      statuses[status] = (statuses[status] or 0) + 1
      return
   end
   if replayed then
      replays = replays + 1
      return
   end
   sent[key] = nil
   original.key = key
   answered[answered_next] = original
   answered_next = answered_next % REPLAY_WINDOW + 1
   if original.path == "/v1/charges" then
      charges = charges + 1
      refund_tail = refund_tail + 1
      to_refund[refund_tail] = body:match('"id":"(ch_[%w]+)"')
   else
      refunds = refunds + 1
   end
end

function done(summary, latency, requests)
   local totals = { charges = 0, refunds = 0, replays = 0, unexpected = 0 }
   local by_status = {}
   for _, thread in ipairs(threads) do
      for name in pairs(totals) do
         totals[name] = totals[name] + thread:get(name)
      end
      for status, n in pairs(thread:get("statuses")) do
         by_status[#by_status + 1] = string.format('"%d":%d', status, n)
      end
   end
   local seconds = summary.duration / 1e6
   local e = summary.errors
   local line = string.format(
      '{"kind":"soak_load","requests":%d,"seconds":%.3f,"rps":%.1f,"charges":%d,"refunds":%d,"replays":%d,'
         .. '"unexpected":%d,"unexpected_by_status":{%s},"p50_ms":%.3f,"p99_ms":%.3f,"socket_errors":%d}',
      summary.requests, seconds, summary.requests / seconds, totals.charges, totals.refunds, totals.replays,
      totals.unexpected, table.concat(by_status, ","), latency:percentile(50) / 1000,
      latency:percentile(99) / 1000, e.connect + e.read + e.write + e.timeout)
   if out then
      local f = assert(io.open(out, "a"))
      f:write(line .. "\n")
      f:close()
   else
      io.write(line .. "\n")
   end
end
