-- wrk script for scripts/bench's replay cache memory run: POST /v1/charges
-- with the largest metadata a charge accepts (50 keys of 40 characters, each
-- with a value of 500), walking the keys PREFIX-1 .. PREFIX-COUNT once across
-- all threads, then stopping. Run it twice: once to create the charges, once
-- to replay each of them. Settings come from the environment:
--   BENCH_API_KEY     the merchant's secret key
--   BENCH_MEM_PREFIX  the keys' prefix, unique to the run
--   BENCH_MEM_KEYS    how many keys (charges)
--   BENCH_MEM_PHASE   create (every answer must be a new 201) or replay
--                     (every answer must be a replayed 201)
--   BENCH_MEM_THREADS the thread count given to wrk (-t)
--   BENCH_MEM_DONE    a folder: each thread writes done-<n> there when all of
--                     its answers are in (wrk runs for its whole -d otherwise,
--                     so the caller interrupts it once every thread is done)
--   BENCH_OUT         where done() appends its result as one JSON line
-- Each thread walks its own keys (thread t of T takes t, t+T, t+2T, ...) and
-- stops once all of its answers are in; a connection with no key left asks
-- GET /healthz instead, which is not counted.

local api_key = assert(os.getenv("BENCH_API_KEY"), "BENCH_API_KEY is not set")
local prefix = assert(os.getenv("BENCH_MEM_PREFIX"), "BENCH_MEM_PREFIX is not set")
local count = tonumber(os.getenv("BENCH_MEM_KEYS") or "20000")
local phase = os.getenv("BENCH_MEM_PHASE") or "create"
local nthreads = tonumber((assert(os.getenv("BENCH_MEM_THREADS"), "BENCH_MEM_THREADS is not set")))
local done_dir = assert(os.getenv("BENCH_MEM_DONE"), "BENCH_MEM_DONE is not set")
local out = os.getenv("BENCH_OUT")

local METADATA_KEYS, KEY_CHARS, VALUE_CHARS = 50, 40, 500

local function body()
   local entries = {}
   for i = 1, METADATA_KEYS do
      local key = string.format("k%02d", i)
      key = key .. string.rep("k", KEY_CHARS - #key)
      local value = string.rep(string.char(97 + i % 26), VALUE_CHARS)
      entries[#entries + 1] = string.format('"%s":"%s"', key, value)
   end
   return '{"amount":2000,"currency":"usd","source":"tok_visa","metadata":{'
      .. table.concat(entries, ",") .. "}}"
end

-- Runs in the main Lua state, once per thread.
local threads = {}
function setup(thread)
   table.insert(threads, thread)
   thread:set("tid", #threads)
end

-- Runs in each thread's own Lua state.
function init(args)
   sent, answered, bad = 0, 0, 0
   -- wrk calls the first thread's request() once before the run, to check
   -- it: that call must not use up a key.
   checking = tid == 1
   share = tid <= count and math.floor((count - tid) / nthreads) + 1 or 0
   if share == 0 then
      assert(io.open(done_dir .. "/done-" .. tid, "w")):close()
   end
   payload = body()
   headers = {
      ["Authorization"] = "Bearer " .. api_key,
      ["Content-Type"] = "application/json",
   }
   health = wrk.format("GET", "/healthz")
end

function request()
   local index = tid + sent * nthreads
   if checking or index > count then
      checking = false
      return health
   end
   sent = sent + 1
   headers["Idempotency-Key"] = prefix .. "-" .. index
   return wrk.format("POST", "/v1/charges", headers, payload)
end

function response(status, headers, body)
   if status == 200 then
      return -- GET /healthz
   end
   answered = answered + 1
   local replayed = headers["idempotent-replayed"] == "true"
   if status ~= 201 or replayed ~= (phase == "replay") then
      bad = bad + 1
   end
   if answered == share then
      assert(io.open(done_dir .. "/done-" .. tid, "w")):close()
      wrk.thread:stop()
   end
end

function done(summary, latency, requests)
   local answered_all, bad_all = 0, 0
   for _, thread in ipairs(threads) do
      answered_all = answered_all + thread:get("answered")
      bad_all = bad_all + thread:get("bad")
   end
   local seconds = summary.duration / 1e6
   local line = string.format(
      '{"kind":"memory_phase","phase":"%s","answered":%d,"unexpected":%d,"seconds":%.3f,"rps":%.1f,"p99_ms":%.3f,"socket_errors":%d}',
      phase, answered_all, bad_all, seconds, answered_all / seconds, latency:percentile(99) / 1000,
      summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout)
   if out then
      local f = assert(io.open(out, "a"))
      f:write(line .. "\n")
      f:close()
   else
      io.write(line .. "\n")
   end
end
