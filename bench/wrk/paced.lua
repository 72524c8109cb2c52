-- wrk script for `scripts/bench limits`: new charges, each with a key of its
-- own, each connection pausing BENCH_DELAY_MS before each request, so that a
-- merchant sends at a set rate rather than flat out.
-- Settings come from the environment:
--   BENCH_API_KEY   the merchant's secret key
--   BENCH_RUN       a tag unique to this run, so that keys never repeat
--   BENCH_DELAY_MS  the pause of a connection before each request
--   BENCH_SIDE      a label for the result (a, b)
--   BENCH_OUT       where done() appends its result as one JSON line
--   BENCH_HIST      1: the result also carries every latency recorded, as
--                   [microseconds, count] pairs ("hist"), so that windows of
--                   several runs can be pooled before taking percentiles
-- It counts answers by status: 201 (charged), 429 (rate limited), others.

local api_key = assert(os.getenv("BENCH_API_KEY"), "BENCH_API_KEY is not set")
local run = os.getenv("BENCH_RUN") or tostring(os.time())
local pause = tonumber(os.getenv("BENCH_DELAY_MS") or "10")
local side = os.getenv("BENCH_SIDE") or "?"
local out = os.getenv("BENCH_OUT")
local hist = os.getenv("BENCH_HIST") == "1"

local threads = {}
function setup(thread)
   table.insert(threads, thread)
   thread:set("tid", #threads)
end

function init(args)
   counter = 0
   statuses = {}
   headers = {
      ["Authorization"] = "Bearer " .. api_key,
      ["Content-Type"] = "application/x-www-form-urlencoded",
   }
end

function delay()
   return pause
end

function request()
   counter = counter + 1
   headers["Idempotency-Key"] = "paced-" .. run .. "-" .. tid .. "-" .. counter
   return wrk.format("POST", "/v1/charges", headers, "amount=2000&currency=usd&source=tok_visa")
end

function response(status, headers, body)
   statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
   local by_status, created = {}, 0
   local counts = {}
   for _, thread in ipairs(threads) do
      for status, n in pairs(thread:get("statuses")) do
         counts[status] = (counts[status] or 0) + n
      end
   end
   for status, n in pairs(counts) do
      by_status[#by_status + 1] = string.format('"%d":%d', status, n)
      if status == 201 then created = n end
   end
   local seconds = summary.duration / 1e6
   local e = summary.errors
   -- latency(i) is the i-th distinct latency recorded and its count.
   local pairs_us = {}
   if hist then
      for i = 1, #latency do
         local us, n = latency(i)
         pairs_us[#pairs_us + 1] = string.format("[%d,%d]", us, n)
      end
   end
   local line = string.format(
      '{"kind":"paced","side":"%s","requests":%d,"seconds":%.3f,"rps":%.1f,"created":%d,"created_rps":%.1f,'
         .. '"by_status":{%s},"p50_ms":%.3f,"p99_ms":%.3f,"socket_errors":%d,"hist":[%s]}',
      side, summary.requests, seconds, summary.requests / seconds, created, created / seconds,
      table.concat(by_status, ","), latency:percentile(50) / 1000, latency:percentile(99) / 1000,
      e.connect + e.read + e.write + e.timeout, table.concat(pairs_us, ","))
   if out then
      local f = assert(io.open(out, "a"))
      f:write(line .. "\n")
      f:close()
   else
      io.write(line .. "\n")
   end
end
