-- wrk script for scripts/bench: POST /v1/charges with one Idempotency-Key per
-- logical operation. Settings come from the environment:
--   BENCH_MODE       new (every request a new key), replay (a random completed
--                    key seed-1 .. seed-BENCH_SEED_KEYS), replay_all (each thread
--                    replays every seeded key in turn, from its own offset: fills
--                    the replay cache), storm (9 in 10 requests retry one of
--                    BENCH_HOT_KEYS hot keys, 1 in 10 is new), hop (the
--                    gateway's call: POST /v1/authorizations, a JSON body and
--                    a new key each, to examples/ceiling.rs serving a saved
--                    authorization: the bare HTTP hop)
--   BENCH_API_KEY    the merchant's secret key
--   BENCH_RUN        a tag unique to this run, so that new keys never repeat
--   BENCH_OUT        where done() appends its result as one JSON line
--   BENCH_CLIENTS    the connection count, copied into that line
--   BENCH_SCENARIO   the scenario named in that line (default: BENCH_MODE),
--                    say replay_miss for replays of a server without cache
--   BENCH_SIDE       who answered, named in that line (default: oncepay;
--                    ceiling for the HTTP ceiling, examples/ceiling.rs)
-- The body is the same for every request, so any completed key replays.

local mode = os.getenv("BENCH_MODE") or "new"
local scenario = os.getenv("BENCH_SCENARIO") or mode
local side = os.getenv("BENCH_SIDE") or "oncepay"
local api_key = assert(os.getenv("BENCH_API_KEY"), "BENCH_API_KEY is not set")
local run = os.getenv("BENCH_RUN") or tostring(os.time())
local seed_keys = tonumber(os.getenv("BENCH_SEED_KEYS") or "100000")
local hot_keys = tonumber(os.getenv("BENCH_HOT_KEYS") or "100")
local out = os.getenv("BENCH_OUT")
local clients = tonumber(os.getenv("BENCH_CLIENTS") or "0")
local body = "amount=2000&currency=usd&source=tok_visa"
local path = "/v1/charges"
if mode == "hop" then
   body = '{"amount":2000,"currency":"usd","source":"tok_visa"}'
   path = "/v1/authorizations"
end

-- Runs in the main Lua state, once per thread: give each thread an id.
local next_id = 1
function setup(thread)
   thread:set("tid", next_id)
   next_id = next_id + 1
end

-- Runs in each thread's own Lua state.
function init(args)
   counter = 0
   math.randomseed(tid * 7919 + os.time())
   if mode == "hop" then
      headers = { ["Content-Type"] = "application/json" }
   else
      headers = {
         ["Authorization"] = "Bearer " .. api_key,
         ["Content-Type"] = "application/x-www-form-urlencoded",
      }
   end
end

local function fresh_key()
   counter = counter + 1
   return "new-" .. run .. "-" .. tid .. "-" .. counter
end

function request()
   local key
   if mode == "new" or mode == "hop" then
      key = fresh_key()
   elseif mode == "replay" then
      key = "seed-" .. math.random(seed_keys)
   elseif mode == "replay_all" then
      counter = counter + 1
      key = "seed-" .. ((counter + (tid - 1) * 7919) % seed_keys) + 1
   elseif math.random(10) == 1 then
      key = fresh_key()
   else
      key = "hot-" .. run .. "-" .. math.random(hot_keys)
   end
   headers["Idempotency-Key"] = key
   return wrk.format("POST", path, headers, body)
end

-- No response() callback: with one, wrk hands every response to Lua, which
-- costs the load generator CPU it shares with the server. Non-2xx/3xx answers
-- are counted by wrk itself (errors.status).
function done(summary, latency, requests)
   local seconds = summary.duration / 1e6
   local e = summary.errors
   local line = string.format(
      '{"kind":"run","side":"%s","scenario":"%s","clients":%d,"requests":%d,"seconds":%.3f,"rps":%.1f,"p50_ms":%.3f,"p99_ms":%.3f,'
         .. '"mean_ms":%.3f,"max_ms":%.3f,"non_2xx":%d,"socket_errors":%d}',
      side, scenario, clients, summary.requests, seconds, summary.requests / seconds,
      latency:percentile(50) / 1000, latency:percentile(99) / 1000,
      latency.mean / 1000, latency.max / 1000, e.status, e.connect + e.read + e.write + e.timeout)
   if out then
      local f = assert(io.open(out, "a"))
      f:write(line .. "\n")
      f:close()
   else
      io.write(line .. "\n")
   end
end
