-- wrk script for `scripts/bench shed`: new charges (a fresh Idempotency-Key
-- each) from many connections at once, flat out, and what became of them.
-- Settings come from the environment:
--   BENCH_API_KEY    the merchant's secret key
--   BENCH_RUN        a tag unique to this run, so that keys never repeat
--   BENCH_SIDE       the run's name in the result line (on, off, baseline)
--   BENCH_CLIENTS    the connection count, copied into that line
--   BENCH_OUT        where done() appends its result as one JSON line
--   BENCH_POLITE     1: clients wait out Retry-After after a 503 (below)
--
-- wrk's own latency figures mix every answer; this script times the
-- answers by status. Each request carries its send time (a monotonic clock
-- read through LuaJIT's ffi, in microseconds) as its X-Request-Id, which
-- the server echoes on every answer; response() subtracts it from the time
-- the answer is read. A connection is closed-loop: its next request goes
-- out as soon as the answer is in, a 503's too (Retry-After is not
-- honoured: the harshest client). With BENCH_POLITE=1, a 503 makes a
-- connection wait its Retry-After before its next request instead. wrk
-- asks delay() for the next request of a connection without saying which,
-- shortly after that connection's answer went through response(): each
-- 503 queues one wait and each delay() takes the oldest, so as many
-- requests wait as 503s asked for, though not always on the very
-- connection that got the 503.

local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } shed_timespec;
int clock_gettime(int clock_id, shed_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local ts = ffi.new("shed_timespec")
local function now_us()
   ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
   return tonumber(ts.tv_sec) * 1000000 + math.floor(tonumber(ts.tv_nsec) / 1000)
end

local api_key = assert(os.getenv("BENCH_API_KEY"), "BENCH_API_KEY is not set")
local run = os.getenv("BENCH_RUN") or tostring(os.time())
local side = os.getenv("BENCH_SIDE") or "oncepay"
local clients = tonumber(os.getenv("BENCH_CLIENTS") or "0")
local out = os.getenv("BENCH_OUT")
local body = "amount=2000&currency=usd&source=tok_visa"
local polite = os.getenv("BENCH_POLITE") == "1"

local threads = {}
function setup(thread)
   table.insert(threads, thread)
   thread:set("tid", #threads)
end

-- Runs in each thread's own Lua state.
function init(args)
   counter = 0
   created, created_n = {}, 0 -- latencies of the 201s, microseconds
   shed, shed_n = {}, 0       -- latencies of the 503 overloaded
   other = {}                 -- count by status (and 503 code)
   waits, waits_head, waits_tail = {}, 1, 0 -- Retry-After waits due, ms
   headers = {
      ["Authorization"] = "Bearer " .. api_key,
      ["Content-Type"] = "application/x-www-form-urlencoded",
   }
end

function request()
   counter = counter + 1
   headers["Idempotency-Key"] = "shed-" .. run .. "-" .. tid .. "-" .. counter
   headers["X-Request-Id"] = "t" .. now_us()
   return wrk.format("POST", "/v1/charges", headers, body)
end

function response(status, response_headers, response_body)
   local id = response_headers["x-request-id"] or response_headers["X-Request-Id"] or ""
   local sent = tonumber(string.sub(id, 2))
   local took = sent and (now_us() - sent) or nil
   if polite and status == 503 then
      waits_tail = waits_tail + 1
      waits[waits_tail] = 1000 * (tonumber(response_headers["retry-after"] or "1") or 1)
   end
   if status == 201 and took then
      created_n = created_n + 1
      created[created_n] = took
   elseif status == 503 and took and string.find(response_body, '"code":"overloaded"', 1, true) then
      shed_n = shed_n + 1
      shed[shed_n] = took
   else
      local name = tostring(status)
      if status >= 400 then
         local code = string.match(response_body, '"code":"([a-z_]+)"')
         if code then name = name .. " " .. code end
      end
      other[name] = (other[name] or 0) + 1
   end
end

if polite then
   function delay()
      if waits_head > waits_tail then return 0 end
      local wait = waits[waits_head]
      waits[waits_head] = nil
      waits_head = waits_head + 1
      return wait
   end
end

local function percentile(sorted, p)
   if #sorted == 0 then return 0 end
   local i = math.max(1, math.ceil(#sorted * p / 100))
   return sorted[i] / 1000
end

function done(summary, latency, requests)
   local all_created, all_shed, others = {}, {}, {}
   for _, thread in ipairs(threads) do
      for _, v in ipairs(thread:get("created")) do table.insert(all_created, v) end
      for _, v in ipairs(thread:get("shed")) do table.insert(all_shed, v) end
      for k, v in pairs(thread:get("other")) do others[k] = (others[k] or 0) + v end
   end
   table.sort(all_created)
   table.sort(all_shed)
   local seconds = summary.duration / 1e6
   local e = summary.errors
   local parts = {}
   for k, v in pairs(others) do table.insert(parts, string.format('"%s":%d', k, v)) end
   local line = string.format(
      '{"kind":"shed","side":"%s","clients":%d,"seconds":%.3f,"answered":%d,"rps":%.1f,'
         .. '"created":%d,"created_rps":%.1f,"created_p50_ms":%.3f,"created_p99_ms":%.3f,"created_max_ms":%.3f,'
         .. '"shed":%d,"shed_p50_ms":%.3f,"shed_p99_ms":%.3f,"other":{%s},"socket_errors":%d}',
      side, clients, seconds, summary.requests, summary.requests / seconds,
      #all_created, #all_created / seconds, percentile(all_created, 50), percentile(all_created, 99),
      percentile(all_created, 100), #all_shed, percentile(all_shed, 50), percentile(all_shed, 99),
      table.concat(parts, ","), e.connect + e.read + e.write + e.timeout)
   if out then
      local f = assert(io.open(out, "a"))
      f:write(line .. "\n")
      f:close()
   else
      io.write(line .. "\n")
   end
end
