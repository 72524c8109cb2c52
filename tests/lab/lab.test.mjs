// The lab page (GET /lab), end to end: a real `oncepay serve` on a fresh
// database, the page in headless Chromium (Debian's /usr/bin/chromium driven
// by playwright-core), every scenario clicked, and every effect count the
// page shows (payments, scenario 6's orders shipped by the webhook receivers,
// scenario 7's money refunded, scenario 10's payments in the card gateway's
// ledger) checked against the database with psql.
// Every server but the last test's runs under the workshop's own settings
// (scripts/lib/workshop.env). Scenarios 8 and 9 run on a second one with
// Redis (REDIS_URL, default redis://127.0.0.1:6379), which this test
// restarts on its port whenever it exits, as scripts/workshop does, since
// scenario 8 crashes it on purpose. After every test, the
// page must have raised no script error (an uncaught exception or rejection,
// or a console.error; the browser's own "Failed to load resource" lines are
// expected, the scenarios get 409s and dropped answers on purpose). Saves
// screenshots to target/lab/: lab.png (the whole page), scenario-*.png, and
// present-*.png (cards in the presenter's view, GET /lab?present, 1280x720).
//
// Run by scripts/test after cargo test; alone:
//   cargo build --bin oncepay && (cd tests/lab && npm ci) &&
//   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres node --test tests/lab/lab.test.mjs
// Against a running scripts/workshop instead (every card on its one server,
// its database oncepay_workshop on DATABASE_URL's server, its demo key):
//   LAB_URL=http://127.0.0.1:8080 node --test tests/lab/lab.test.mjs
//
// Settings (environment): DATABASE_URL (any database of a server where the
// user may create databases), REDIS_URL, ONCEPAY_BIN (default
// target/debug/oncepay), CHROMIUM (default /usr/bin/chromium).

import { after, afterEach, before, test } from "node:test";
import assert from "node:assert/strict";
import { existsSync, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";
import * as oncepay from "../support/oncepay.mjs";
import { BIN, ROOT, createDatabase, newApiKey, psql, stop, workshopSettings } from "../support/oncepay.mjs";

const OUT = join(ROOT, "target", "lab");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
// A running scripts/workshop to drive instead of servers of the test's own:
// its address, its database and its merchant key.
const WORKSHOP = process.env.LAB_URL || null;
const WORKSHOP_DATABASE = process.env.LAB_DATABASE_URL || oncepay.withDatabase(oncepay.SERVER_URL, "oncepay_workshop");
const API_KEY = WORKSHOP ? process.env.LAB_API_KEY || "sk_test_oncepayDemoKey00000000000000000000" : newApiKey("lab");
const SCENARIO_TIMEOUT = 60_000;
const REDIS_URL = process.env.REDIS_URL || "redis://127.0.0.1:6379";
const NATS_URL = process.env.NATS_URL || "nats://127.0.0.1:4222";

const servers = [];
const supervisors = [];
let context = null;
let page = null;
/** The model's explorer the lab links to (`oncepay.explore`). */
let explorer = null;
let base = null;
let dbUrl = null;
let db = null;
let userDataDir = null;
const pageErrors = [];

// ---- helpers ----------------------------------------------------------------

/** The payment keys of the charges tagged with run TAG, as an SQL list, from
 * oncepay's database (URL); the card gateway's ledger is beside it, in
 * `<database>_processor` (the server embeds the gateway). */
function paymentKeys(tag, url) {
  assert.match(tag, /^lab-[0-9a-f]+$/, `unexpected run tag ${tag}`);
  return psql(
    url,
    `SELECT coalesce(string_agg(quote_literal('auth:' || id), ','), 'NULL')
       FROM charges WHERE metadata->>'demo_run' = '${tag}'`,
  );
}

const ledgerOf = (url) => {
  const u = new URL(url);
  u.pathname = u.pathname + "_processor";
  return u.toString();
};

/** Processor payments (money moved) for the charges tagged with run TAG. */
function paymentsInDb(tag, url = dbUrl) {
  const keys = paymentKeys(tag, url);
  return Number(
    psql(ledgerOf(url), `SELECT count(*) FROM operations WHERE outcome = 'succeeded' AND key IN (${keys})`),
  );
}

/** Money the processor refunded from the payments of the charges tagged TAG. */
function refundedInDb(tag) {
  const keys = paymentKeys(tag, dbUrl);
  return Number(
    psql(
      ledgerOf(dbUrl),
      `SELECT coalesce(sum(amount), 0) FROM operations WHERE outcome = 'refunded' AND payment_key IN (${keys})`,
    ),
  );
}

/** Orders the webhook receiver MODE of run TAG shipped, and the deliveries it took in. */
function receiverInDb(tag, mode) {
  assert.match(tag, /^lab-[0-9a-f]+$/, `unexpected run tag ${tag}`);
  const [shipments, deliveries] = psql(
    dbUrl,
    `SELECT (SELECT count(*) FROM demo_shipments WHERE run = '${tag}' AND mode = '${mode}'),
            (SELECT coalesce(sum(deliveries), 0) FROM demo_receiver_deliveries
              WHERE run = '${tag}' AND mode = '${mode}')`,
  ).split("|");
  return { shipments: Number(shipments), deliveries: Number(deliveries) };
}

const times4 = (x) => [x, x, x, x];

const byId = (id) => page.locator(`[data-testid="${id}"]`);
const text = async (id) => (await byId(id).textContent()).trim();
const number = async (id) => Number(await text(id));

/** Clicks scenario ID's button and waits until it has finished. */
async function run(id) {
  await byId("run-" + id).click();
  const section = byId("scenario-" + id);
  await page.waitForFunction(
    (sel) => ["done", "error"].includes(document.querySelector(sel)?.dataset.state),
    `[data-testid="scenario-${id}"]`,
    { timeout: SCENARIO_TIMEOUT },
  );
  const state = await section.getAttribute("data-state");
  assert.equal(state, "done", `scenario ${id} ended in ${state}: ${await text("message")}`);
}

/** The part's "effects after", checked against the database (URL); returns it. */
async function effectsAfter(part, url = dbUrl) {
  const tag = await text(part + "-tag");
  const shown = await number(part + "-effects-after");
  assert.equal(await number(part + "-effects-before"), 0, `${part}: a fresh run starts at 0`);
  assert.equal(shown, paymentsInDb(tag, url), `${part}: the page shows what the database holds for ${tag}`);
  return shown;
}

/** The answers shown in the rows of a timeline part (scenarios 7 to 9). */
async function answers(part) {
  const out = [];
  for (let i = 1; await byId(`${part}-row-${i}`).count(); i++) out.push(await text(`${part}-row-${i}-status`));
  return out;
}

async function rows(part) {
  const out = [];
  for (let i = 1; await byId(`${part}-row-${i}`).count(); i++) {
    out.push({
      status: await text(`${part}-row-${i}-status`),
      replayed: (await text(`${part}-row-${i}-replayed`)) === "replayed",
      charge: await text(`${part}-row-${i}-charge`),
    });
  }
  return out;
}

/** What PART's timeline drew: its lanes top to bottom, and each event drawn
 * (its lane, mark, what, and whether it was drawn as a duplicate effect). */
async function drawing(part) {
  return byId(part + "-trace").evaluate((card) => ({
    lanes: [...card.querySelectorAll("text.lane")].map((t) => t.dataset.lane),
    events: [...card.querySelectorAll("g.event")].map((g) => ({
      lane: g.dataset.lane,
      mark: g.dataset.mark,
      what: g.dataset.what,
      duplicate: g.dataset.duplicate === "true",
    })),
  }));
}

/** The events the server at BASE recorded and stored for PART's run. */
async function recorded(part, base) {
  const tag = await text(part + "-tag");
  const res = await fetch(`${base}/demo/trace?run=${tag}`, { headers: { Authorization: `Bearer ${API_KEY}` } });
  assert.equal(res.status, 200, `GET /demo/trace for ${tag}`);
  return (await res.json()).events;
}

/**
 * Checks that PART's timeline draws exactly the events the server at BASE
 * holds for its run (unless BASE is null: a later crash took them), with
 * request lanes LABELS (when given) first, then oncepay, the card gateway,
 * Redis when used, and the database; returns the drawing, a count of each
 * mark, and how many effects it drew as duplicates.
 */
async function drawsItsRun(part, base, labels) {
  const drawn = await drawing(part);
  const lane = (e) => (e.lane === "request" ? e.request : e.lane);
  const summary = (list) => list.map((e) => `${e.lane}|${e.mark || ""}|${e.what}`).sort();
  if (base) {
    const events = (await recorded(part, base)).map((e) => ({ ...e, lane: lane(e) }));
    assert.deepEqual(summary(drawn.events), summary(events), `${part}: the drawing holds the recorded events`);
  }
  const redis = drawn.events.some((e) => e.lane === "redis");
  const systems = ["oncepay", "card gateway", ...(redis ? ["Redis"] : []), "database"];
  if (labels) assert.deepEqual(drawn.lanes, [...labels, ...systems], `${part}: its lanes`);
  else assert.deepEqual(drawn.lanes.slice(-systems.length), systems, `${part}: its systems' lanes`);
  // A mark on a request's lane is what that client saw; oncepay's lane
  // repeats answers, conflicts and replays as the decisions it made.
  const SYSTEM = ["oncepay", "gateway", "redis", "database"];
  const count = (mark, on = null) =>
    drawn.events.filter((e) => e.mark === mark && (on !== "requests" || !SYSTEM.includes(e.lane))).length;
  const duplicates = drawn.events.filter((e) => e.duplicate).length;
  return { drawn, count, duplicates };
}

/** Starts `oncepay serve` on the test database and a free port, with ENV. */
async function serve(logName, env) {
  const { proc, base: url } = await oncepay.serve({
    databaseUrl: dbUrl,
    apiKey: API_KEY,
    logPath: join(OUT, logName),
    env,
  });
  servers.push(proc);
  return { proc, base: url };
}

/**
 * `oncepay serve` on a database of its own with ENV, started again on the
 * same port whenever it exits (each start's log numbered), as a supervisor
 * restarts a crashed service: `{ base, db, restarts, errors }`.
 */
async function supervised(logName, env) {
  const db = createDatabase("oncepay_lab_pitfalls");
  const sup = { db, restarts: 0, errors: [], stopped: false, proc: null, base: null };
  const start = async (port) => {
    const started = await oncepay.serve({
      databaseUrl: db.url,
      apiKey: API_KEY,
      logPath: join(OUT, `${logName}-${sup.restarts}.log`),
      env,
      port,
    });
    servers.push(started.proc);
    sup.proc = started.proc;
    started.proc.on("exit", () => {
      if (sup.stopped) return;
      sup.restarts += 1;
      start(started.port).catch((e) => sup.errors.push(String(e)));
    });
    return started;
  };
  sup.base = (await start(undefined)).base;
  supervisors.push(sup);
  return sup;
}

let pitfalls = null;

/** The server of scenarios 8 and 9, started on first use (the workshop's
 * own, restarted by scripts/workshop, when the test drives one). */
async function pitfallsServer() {
  if (WORKSHOP) return { base: WORKSHOP, db: { url: dbUrl }, restarts: null, errors: [] };
  if (pitfalls) return pitfalls;
  // Its timelines outlive its crashes in a journal, as scripts/workshop's do.
  const journal = join(OUT, "traces-pitfalls.jsonl");
  rmSync(journal, { force: true });
  pitfalls = await supervised("server-pitfalls", { ...workshopSettings(), REDIS_URL, DEMO_TRACE_FILE: journal });
  return pitfalls;
}

// ---- set-up and clean-up ----------------------------------------------------

before(async () => {
  assert.ok(existsSync(BIN), `${BIN} is missing: run cargo build --bin oncepay first`);
  assert.ok(existsSync(CHROMIUM), `${CHROMIUM} is missing: apt-get install chromium`);
  mkdirSync(OUT, { recursive: true });

  if (WORKSHOP) {
    [base, dbUrl] = [WORKSHOP, WORKSHOP_DATABASE];
  } else {
    db = createDatabase("oncepay_lab");
    dbUrl = db.url;
    explorer = await oncepay.explore("check-then-act");
    // Every card under the workshop's own settings, as scripts/workshop runs them,
    // the model's explorer linked as it links it.
    const env = { ...workshopSettings(), NATS_URL, DEMO_MODEL_URL: explorer.counterexample };
    ({ base } = await serve("server.log", env));
  }

  userDataDir = mkdtempSync(join(tmpdir(), "oncepay-lab-chromium-"));
  context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM,
    headless: true,
    viewport: { width: 1280, height: 720 },
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  page = context.pages()[0] || (await context.newPage());
  page.on("pageerror", (e) => pageErrors.push(`uncaught: ${e}`));
  page.on("console", (m) => {
    // Chromium logs every 4xx and every dropped connection as a console
    // error of its own; only the page's console.error calls count.
    if (m.type() === "error" && !m.text().startsWith("Failed to load resource:")) {
      pageErrors.push(`console.error: ${m.text()}`);
    }
  });
  await page.goto(`${base}/lab?key=${API_KEY}`);
});

after(async () => {
  await context?.close().catch(() => {});
  if (userDataDir) rmSync(userDataDir, { recursive: true, force: true });
  for (const sup of supervisors) sup.stopped = true;
  for (const proc of servers) await stop(proc);
  if (explorer) await stop(explorer.proc);
  db?.drop();
  for (const sup of supervisors) sup.db.drop();
});

// Every test, the last one included, ends with the page free of script errors;
// the round trip first lets Chromium deliver what it raised before it.
afterEach(async () => {
  await page?.evaluate(() => undefined).catch(() => {});
  assert.deepEqual(pageErrors.splice(0), [], "the page raised script errors during this test");
});

// ---- the scenarios ----------------------------------------------------------

test("the page takes the merchant key from the address, remembers it, and works offline", async () => {
  assert.equal(await byId("api-key").inputValue(), API_KEY);
  await page.goto(`${base}/lab`);
  assert.equal(await byId("api-key").inputValue(), API_KEY, "remembered in local storage");
  // The SVG namespace is a name the timelines are made in, not an address;
  // the model's explorer runs on this machine.
  const html = (await page.content()).replaceAll('"http://www.w3.org/2000/svg"', "");
  assert.ok(!/https?:\/\/(?!127\.0\.0\.1[:/])/.test(html), "nothing loaded from the internet");
});

test("1: four requests without a key apply the effect four times", async () => {
  await run("1");
  assert.equal(await effectsAfter("s1"), 4);
  assert.deepEqual(
    (await rows("s1")).map((r) => r.charge),
    ["#1", "#2", "#3", "#4"],
  );
  assert.match(await text("s1-verdict"), /duplicates/);
  const t = await drawsItsRun("s1", base, ["try 1", "try 2", "try 3", "try 4"]);
  assert.deepEqual([t.count("effect"), t.duplicates, t.count("answer", "requests")], [4, 3, 4], "each try moved money");
});

test("2: the same four requests with one key apply it once", async () => {
  await run("2");
  assert.equal(await effectsAfter("s2"), 1);
  const r = await rows("s2");
  assert.deepEqual(
    r.map((x) => [x.status, x.replayed, x.charge]),
    [
      ["201 Created", false, "#1"],
      ["201 Created", true, "#1"],
      ["201 Created", true, "#1"],
      ["201 Created", true, "#1"],
    ],
  );
  assert.match(await text("s2-key-state"), /completed/);
  assert.match(await text("s2-verdict"), /exactly once/);
});

test("3: a lost answer, then a retry, is one effect", async () => {
  await run("3");
  assert.equal(await number("s3-effects-mid"), 1, "the effect happened before the answer was lost");
  assert.equal(await effectsAfter("s3"), 1);
  const r = await rows("s3");
  assert.match(r[0].status, /no answer/);
  assert.deepEqual([r[1].status, r[1].replayed, r[1].charge], ["201 Created", true, "#1"]);
  const t = await drawsItsRun("s3", base, ["first try", "retry"]);
  assert.deepEqual([t.count("replay", "requests"), t.count("effect"), t.duplicates], [1, 1, 0]);
  // Chromium may send the first try again by itself when its connection
  // closes without an answer: each is lost, each on the first try's lane.
  const lost = t.drawn.events.filter((e) => e.mark === "lost" && e.lane !== "oncepay");
  assert.ok(lost.length >= 1 && lost.every((e) => e.lane === "first try"), JSON.stringify(lost));
  assert.equal(t.drawn.events.find((e) => e.mark === "replay").lane, "retry", "the retry got the saved answer");
});

test("4: two at once with one key: 1 effect on the real endpoint, 2 on the naive one", async () => {
  await run("4");
  assert.equal(await effectsAfter("s4-real"), 1);
  const statuses = (await rows("s4-real")).map((r) => r.status.split(" ")[0]).sort();
  assert.deepEqual(statuses, ["201", "409"]);
  assert.equal(await effectsAfter("s4-naive"), 2);
  assert.deepEqual(
    (await rows("s4-naive")).map((r) => r.charge).sort(),
    ["#1", "#2"],
  );
  const real = await drawsItsRun("s4-real", base, ["A", "B"]);
  assert.deepEqual([real.count("conflict", "requests"), real.count("effect"), real.duplicates], [1, 1, 0]);
  const claims = real.drawn.events.filter((e) => e.lane === "database" && /claim/.test(e.what));
  assert.equal(claims.length, 2, "both requests tried to claim the key");
  const naive = await drawsItsRun("s4-naive", base, ["A", "B"]);
  assert.deepEqual([naive.count("answer", "requests"), naive.count("effect"), naive.duplicates], [2, 2, 1]);
});

test("5: three attempts with one key are 1 effect, with a new key each 3", async () => {
  await run("5");
  const one = await effectsAfter("s5-one");
  const fresh = await effectsAfter("s5-new");
  assert.deepEqual([one, fresh], [1, 3]);
  assert.equal(await number("s5-effects-total"), 4);
});

test("6: an event delivered three times ships 3 orders without an inbox, 1 with one", async () => {
  await run("6");
  assert.match(await text("s6-event"), /^evt_[A-Za-z0-9]{24}$/);
  for (const [part, mode, shipped] of [["s6-naive", "naive", 3], ["s6-inbox", "inbox", 1]]) {
    const tag = await text(part + "-tag");
    const db = receiverInDb(tag, mode);
    assert.equal(await number(part + "-effects-before"), 0, `${part}: a fresh run starts at 0`);
    assert.equal(await number(part + "-effects-after"), db.shipments, `${part}: the page shows the database's shipments`);
    assert.equal(db.shipments, shipped, part);
    assert.equal(await number(part + "-deliveries"), db.deliveries, `${part}: deliveries as in the database`);
    assert.equal(db.deliveries, 3, part);
    const statuses = [];
    for (let i = 1; await byId(`${part}-row-${i}`).count(); i++) statuses.push(await text(`${part}-row-${i}-status`));
    assert.deepEqual(statuses, ["500", "500", "200"], part);
  }
  assert.match(await text("s6-naive-verdict"), /duplicates: 3 orders/);
  assert.match(await text("s6-inbox-verdict"), /exactly once/);
  // The page deleted its endpoints: later runs' events go nowhere.
  assert.equal(Number(psql(dbUrl, "SELECT count(*) FROM webhook_endpoints WHERE status <> 'deleted'")), 0);
});

test("7: two refunds at once with their own keys: 600 of 1000 refunded on the real endpoint, 1200 on the naive one", async () => {
  await run("7");
  for (const [part, refunded] of [["s7-real", 600], ["s7-naive", 1200]]) {
    const tag = await text(part + "-tag");
    assert.equal(await number(part + "-effects-before"), 0, `${part}: a fresh run starts at 0`);
    assert.equal(await number(part + "-effects-after"), refundedInDb(tag), `${part}: the page shows the database's refunds`);
    assert.equal(refundedInDb(tag), refunded, part);
    assert.equal(await number(part + "-charged"), 1000, part);
    assert.equal(paymentsInDb(tag), 1, `${part}: one charge`);
  }
  const [, ...real] = await answers("s7-real");
  assert.deepEqual(real.sort(), ["201 Created: refunded 600", "400 amount_too_large"]);
  const [, ...naive] = await answers("s7-naive");
  assert.deepEqual(naive, ["201 Created: refunded 600", "201 Created: refunded 600"]);
  assert.match(await text("s7-real-verdict"), /never more than was charged/);
  assert.match(await text("s7-naive-verdict"), /refunded more than was charged/);
});

/** Payments the card gateway's ledger holds under the processor keys of
 * scenario 10's run TAG (`demo:TAG`, `demo:TAG:attempt-N`). */
function ledgerPaymentsInDb(tag, url = dbUrl) {
  assert.match(tag, /^lab-[0-9a-f]+$/, `unexpected run tag ${tag}`);
  return Number(
    psql(
      ledgerOf(url),
      `SELECT count(*) FROM operations
        WHERE outcome = 'succeeded' AND (key = 'demo:${tag}' OR key LIKE 'demo:${tag}:attempt-%')`,
    ),
  );
}

test("10: a lost answer asked again with a new processor key pays twice, with the same key once", async () => {
  await run("10");
  for (const [part, payments] of [["s10-new", 2], ["s10-same", 1]]) {
    const tag = await text(part + "-tag");
    assert.equal(await number(part + "-effects-before"), 0, `${part}: a fresh run starts at 0`);
    assert.equal(await number(part + "-effects-after"), ledgerPaymentsInDb(tag), `${part}: the page shows the ledger`);
    assert.equal(ledgerPaymentsInDb(tag), payments, part);
    assert.deepEqual(await answers(part), ["no answer", "succeeded"], part);
  }
  assert.match(await text("s10-new-verdict"), /paid 2 times/);
  assert.match(await text("s10-same-verdict"), /exactly once/);
  for (const [part, duplicates] of [["s10-new", 1], ["s10-same", 0]]) {
    const t = await drawsItsRun(part, base, null);
    assert.ok(t.count("lost") >= 1, `${part}: the gateway's answer was lost`);
    assert.deepEqual([t.count("effect"), t.duplicates], [1 + duplicates, duplicates], part);
  }
});

/** Ledger entries booked by the scenario-12 handler HANDLER of run TAG. */
function bookedInDb(tag, handler) {
  assert.match(tag, /^lab-[0-9a-f]+$/, `unexpected run tag ${tag}`);
  return Number(psql(dbUrl, `SELECT count(*) FROM ledger_entries WHERE consumer = 'workshop-${handler}-${tag}'`));
}

test("12: an event delivered twice is booked once through the inbox and twice without it", async () => {
  await run("12");
  for (const [part, handler, booked] of [["s12-inbox", "inbox", 1], ["s12-naive", "naive", 2]]) {
    const tag = await text(part + "-tag");
    assert.equal(await number(part + "-effects-before"), 0, `${part}: a fresh run starts at 0`);
    assert.equal(await number(part + "-effects-after"), bookedInDb(tag, handler), `${part}: the page shows the database`);
    assert.equal(bookedInDb(tag, handler), booked, part);
    assert.equal((await answers(part)).length, 2, `${part}: two deliveries`);
  }
  assert.match(await text("s12-inbox-verdict"), /exactly once/);
  assert.match(await text("s12-naive-verdict"), /duplicates: 2 bookings/);
  assert.deepEqual(await answers("s12-window"), ["stored", "duplicate: dropped", "stored"]);
  assert.equal(await number("s12-window-effects-inside"), 1);
  assert.equal(await number("s12-window-effects-after"), 2);
});

test("N at once with one key is one effect", async () => {
  await byId("n-input").fill("8");
  await run("n");
  assert.equal((await rows("sn")).length, 8);
  assert.equal(await effectsAfter("sn"), 1);
});

test("N at once with Prefer: wait replays the first answer to the others", async () => {
  await byId("n-input").fill("4");
  await byId("prefer-wait").check();
  await run("n");
  const r = await rows("sn");
  assert.deepEqual(r.map((x) => [x.status, x.charge]), times4(["201 Created", "#1"]));
  assert.equal(r.filter((x) => x.replayed).length, 3);
  assert.equal(await effectsAfter("sn"), 1);
  await byId("prefer-wait").uncheck();
});

test("the screenshots are saved", async () => {
  await page.evaluate(() => window.scrollTo(0, 0));
  await page.screenshot({ path: join(OUT, "lab.png"), fullPage: true });
  for (const id of ["1", "2", "3", "4", "5", "6", "7", "10", "12", "n"]) {
    await byId("scenario-" + id).screenshot({ path: join(OUT, `scenario-${id}.png`) });
  }
  console.log(`# screenshot: ${join(OUT, "lab.png")}`);
});

test("8: a crash between the commits: Redis's key gets 409 until its TTL, then a second charge; the real key is settled and replayed", async () => {
  const pit = await pitfallsServer();
  await page.goto(`${pit.base}/lab?key=${API_KEY}`);
  await run("8");
  assert.deepEqual(pit.errors, [], "every restart worked");
  if (pit.restarts !== null) assert.equal(pit.restarts, 2, "the page crashed the server twice, and it came back");

  assert.equal(await effectsAfter("s8-redis", pit.db.url), 2, "the bug: a second charge");
  const redis = await answers("s8-redis");
  // Or, when Chromium retried the POST on a fresh connection by itself, that retry's 409.
  assert.match(redis[0], /^no answer \(the server died\)/);
  assert.equal(redis[1], "restarted");
  const conflicts = redis.slice(2, -1);
  assert.ok(conflicts.length >= 1, `retries within the TTL: ${redis}`);
  for (const a of conflicts) assert.match(a, /^409 idempotency_key_in_use: Redis says processing/);
  assert.equal(redis.at(-1), "201 Created");
  assert.match(await text("s8-redis-verdict"), /a second charge/);

  assert.equal(await effectsAfter("s8-real", pit.db.url), 1, "one charge");
  const real = await answers("s8-real");
  assert.match(real[0], /^no answer \(the server died\)/);
  assert.equal(real[1], "restarted");
  assert.ok(real.includes("completed by the sweeper"), `${real}`);
  assert.equal(real.at(-1), "201 Created (replayed)");
  assert.match(await text("s8-real-verdict"), /exactly once/);

  // Each crash is drawn as cards 3 and 4 draw a lost answer: the crashed
  // request's lane, its gateway call and the money moved there, oncepay
  // dying, then the restart; the server's journal kept it all.
  const real8 = await drawsItsRun("s8-real", pit.base, null);
  assert.deepEqual([real8.count("sweeper"), real8.count("restart"), real8.count("effect"), real8.duplicates], [1, 1, 1, 0]);
  assert.equal(real8.count("replay", "requests"), 1, "the retry after the sweeper was replayed");
  const redis8 = await drawsItsRun("s8-redis", pit.base, null);
  assert.deepEqual([redis8.count("restart"), redis8.count("effect"), redis8.duplicates], [1, 2, 1]);
  assert.ok(redis8.count("conflict", "requests") >= 1, "Redis said processing until its TTL");
  for (const t of [real8, redis8]) {
    const crashed = (e) => e.lane === "the charge";
    const events = t.drawn.events;
    assert.equal(t.drawn.lanes[0], "the charge", "the crashed request has the first lane");
    assert.ok(events.some((e) => crashed(e) && e.mark === "lost" && /the server died/.test(e.what)), JSON.stringify(events));
    assert.ok(events.some((e) => e.lane === "oncepay" && e.mark === "lost" && /died/.test(e.what)), "oncepay's death drawn");
    const money = events.find((e) => e.mark === "effect");
    assert.equal(money.lane, "gateway", `the first money moved at the gateway's call: ${JSON.stringify(money)}`);
  }
  await byId("scenario-8").screenshot({ path: join(OUT, "scenario-8.png") });
});

test("9: with a TTL of 2 s, a retry after 1 s is replayed and a retry after 3 s charges again", async () => {
  const pit = await pitfallsServer();
  await page.goto(`${pit.base}/lab?key=${API_KEY}`);
  await run("9");
  assert.equal(await effectsAfter("s9-within", pit.db.url), 1);
  assert.equal(await effectsAfter("s9-after", pit.db.url), 2);
  const within = await answers("s9-within");
  assert.equal(within.length, 3, `${within}`);
  assert.equal(within[0], "201 Created");
  // The server's TTL to the millisecond, not the key's whole Unix seconds.
  assert.equal(within[1], "expires_at = created_at + 2.0 s (IDEMPOTENCY_KEY_TTL)");
  assert.equal(within[2], "201 Created (replayed)");
  const after = await answers("s9-after");
  assert.equal(after.at(-2), "unknown or expired (404)");
  assert.equal(after.at(-1), "201 Created");
  assert.match(await text("s9-after-verdict"), /a new charge/);
  await byId("scenario-9").screenshot({ path: join(OUT, "scenario-9.png") });
});

/** What the presenter's view shows: the cards on the screen. */
const shownCards = () =>
  page.locator(".scenario").evaluateAll((all) =>
    all.filter((s) => s.getBoundingClientRect().height > 0).map((s) => s.dataset.testid.replace("scenario-", "")),
  );

test("the presenter's view shows one card at a time, moved by the arrow keys and the prev/next buttons", async () => {
  await page.goto(`${base}/lab?key=${API_KEY}&present`);
  const cards = await page.locator(".scenario").evaluateAll((all) => all.map((s) => s.dataset.testid.replace("scenario-", "")));
  assert.deepEqual(await shownCards(), ["1"]);
  assert.equal(await text("present-position"), `1 / ${cards.length}`);
  assert.ok(await byId("present-prev").isDisabled(), "nothing before the first card");
  assert.equal(await page.locator("h1").isVisible(), false, "the card has the screen");
  assert.equal(await byId("api-key").isVisible(), false, "the key is set: no settings");
  await page.keyboard.press("ArrowRight");
  assert.deepEqual(await shownCards(), ["2"]);
  await byId("present-next").click();
  assert.deepEqual(await shownCards(), ["3"]);
  assert.match(page.url(), /#3$/, "the address tells the card");
  await page.keyboard.press("ArrowLeft");
  await page.keyboard.press("ArrowLeft");
  await byId("present-next").click();
  assert.deepEqual(await shownCards(), ["2"]);
  await byId("present-prev").click();
  assert.deepEqual(await shownCards(), ["1"]);

  // The address picks a card, with the key before or after `present`.
  await page.goto(`${base}/lab?present&key=${API_KEY}#${cards.at(-1)}`);
  assert.deepEqual(await shownCards(), [cards.at(-1)]);
  assert.equal(await byId("api-key").inputValue(), API_KEY);
  assert.ok(await byId("present-next").isDisabled(), "nothing after the last card");
  // Card N shows its N; arrow keys in a field move its caret, not the cards.
  assert.ok(await byId("n-input").isVisible());
  await byId("n-input").press("ArrowLeft");
  assert.deepEqual(await shownCards(), ["n"]);
  await page.keyboard.press("Escape");

  // The page itself shows every card.
  await page.goto(`${base}/lab?key=${API_KEY}`);
  assert.deepEqual(await shownCards(), cards);
  assert.equal(await byId("present-next").count(), 0);
});

/** What of the presenter's card is off the 1280x720 screen, and the size
 * its timelines' text is rendered at (the SVG's font size times its scale). */
function presented() {
  return page.evaluate(() => {
    const card = document.querySelector(".scenario.current");
    const [w, h] = [window.innerWidth, window.innerHeight];
    const off = (e) => {
      const r = e.getBoundingClientRect();
      return r.height === 0 || r.top < 0 || r.left < 0 || r.bottom > h || r.right > w;
    };
    const counts = [...card.querySelectorAll('[data-testid$="-effects"], [data-testid$="-verdict"]')];
    const svgs = [...card.querySelectorAll(".trace svg")];
    const sizes = svgs.flatMap((svg) => {
      const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
      return [...svg.querySelectorAll("text")].map((t) => parseFloat(getComputedStyle(t).fontSize) * scale);
    });
    return {
      screen: [w, h],
      scrolls: document.documentElement.scrollHeight > h || document.documentElement.scrollWidth > w,
      counts: counts.length,
      countsOff: counts.filter(off).map((e) => e.dataset.testid),
      timelines: svgs.length,
      timelinesOff: svgs.filter(off).map((svg) => svg.closest(".trace").dataset.testid),
      labels: svgs.map((svg) => svg.querySelectorAll("text.what").length),
      smallestText: Math.min(...sizes),
    };
  });
}

test("in the presenter's view at 1280x720, cards 3, 4, 8 and 12 fit the screen after their run, timeline text at 16 px or more", async () => {
  const pit = await pitfallsServer();
  // Card 8 crashes its server on purpose: it runs on the second one.
  const cards = [
    ["3", base, 1, async () => assert.equal(await effectsAfter("s3"), 1)],
    ["4", base, 2, async () => assert.equal(await effectsAfter("s4-naive"), 2)],
    ["8", pit.base, 2, async () => assert.equal(await effectsAfter("s8-redis", pit.db.url), 2)],
    ["12", base, 0, async () => assert.equal(await number("s12-naive-effects-after"), 2)],
  ];
  for (const [id, server, timelines, counted] of cards) {
    await page.goto(`${server}/lab?key=${API_KEY}&present#${id}`);
    assert.deepEqual(await shownCards(), [id]);
    await run(id);
    await counted();
    const seen = await presented();
    // Saved before the checks, so that a card that does not fit can be seen.
    await page.screenshot({ path: join(OUT, `present-${id}.png`) });
    console.log(`# screenshot: ${join(OUT, `present-${id}.png`)}`);
    assert.deepEqual(seen.screen, [1280, 720]);
    assert.equal(seen.scrolls, false, `card ${id}: nothing to scroll to`);
    assert.ok(seen.counts >= 2, `card ${id}: its counts`);
    assert.deepEqual(seen.countsOff, [], `card ${id}: every count and verdict on the screen`);
    assert.equal(seen.timelines, timelines, `card ${id}: its timelines`);
    assert.deepEqual(seen.timelinesOff, [], `card ${id}: every timeline on the screen, its bottom too`);
    for (const n of seen.labels) assert.ok(n >= 1, `card ${id}: a timeline that tells what happened (${seen.labels})`);
    if (timelines) assert.ok(seen.smallestText >= 16, `card ${id}: timeline text rendered at ${seen.smallestText} px`);
  }
});

const OWN_SERVERS = { skip: WORKSHOP ? "drives a running scripts/workshop (LAB_URL)" : false };

test("the lab links the model's explorer, which steps through check-then-act's double charge", OWN_SERVERS, async () => {
  await page.goto(`${base}/lab?key=${API_KEY}`);
  const link = byId("model-link");
  await link.waitFor();
  assert.equal(await link.getAttribute("href"), explorer.counterexample);
  // The explorer at each step of the counterexample, the last where the
  // second payment is recorded.
  const steps = explorer.counterexample.split("#/steps/")[1].split("/");
  const shots = [["start", 2], ["both-read", 8], ["two-payments", steps.length]];
  // The explorer fetches the path's states one by one: each shot waits for
  // its path to be listed whole (the "Pre-init" line, then each step).
  const path = () => page.locator("ol.path-list li").allTextContents();
  for (const [name, upTo] of shots) {
    await page.goto(`${explorer.base}#/steps/${steps.slice(0, upTo).join("/")}`);
    // "Pre-init", then "Init 0" and each action after it.
    await page.waitForFunction((n) => document.querySelectorAll("ol.path-list li").length === n + 1, upTo);
    await page.screenshot({ path: join(OUT, `model-${name}.png`), fullPage: true });
  }
  const actions = (await path()).map((a) => a.trim());
  assert.equal(actions.length, steps.length + 1, "the whole path listed");
  const paid = actions.filter((a) => /^gateway: authorize auth:ch\d+$/.test(a));
  assert.equal(paid.length, 2, `both payments on the path: ${actions}`);
});

test("without the workshop switches, scenarios 3, 4, 6, 7, 8, 9, 10 and 12 say what to turn on", OWN_SERVERS, async () => {
  const plain = await serve("server-plain.log", {});
  await page.goto(`${plain.base}/lab?key=${API_KEY}`);
  await run("3");
  assert.match(await text("s3-note"), /FAULT_INJECTION=true/);
  assert.equal(await effectsAfter("s3"), 0, "the first try was refused, so no retry either");
  await run("4");
  assert.equal(await effectsAfter("s4-real"), 1, "the real endpoint needs no switch");
  assert.match(await text("s4-naive-note"), /DEMO_UNSAFE_ENDPOINTS=true/);
  assert.equal(await effectsAfter("s4-naive"), 0);
  await run("6");
  for (const part of ["s6-naive", "s6-inbox"]) {
    assert.match(await text(part + "-note"), /DEMO_UNSAFE_ENDPOINTS=true/);
    assert.equal(await number(part + "-effects-after"), 0);
  }
  await run("7");
  assert.equal(refundedInDb(await text("s7-real-tag")), 600, "the real endpoint needs no switch");
  assert.match(await text("s7-naive-note"), /DEMO_UNSAFE_ENDPOINTS=true/);
  await run("8");
  for (const part of ["s8-redis", "s8-real"]) {
    const note = await text(part + "-note");
    for (const wanted of ["IDEMPOTENCY_KEY_TTL=2s", "FAULT_INJECTION=true", "DEMO_UNSAFE_ENDPOINTS=true", "REDIS_URL"]) {
      assert.ok(note.includes(wanted), `${part}: ${note}`);
    }
    assert.equal(await number(part + "-effects-after"), 0, "nothing was charged, nothing crashed");
    assert.equal(paymentsInDb(await text(part + "-tag")), 0);
  }
  await run("9");
  assert.equal(await effectsAfter("s9-within"), 1, "a retry within the TTL needs no switch");
  assert.match(await text("s9-after-note"), /IDEMPOTENCY_KEY_TTL=2s/);
  await run("10");
  for (const part of ["s10-new", "s10-same"]) {
    assert.match(await text(part + "-note"), /FAULT_INJECTION=true DEMO_UNSAFE_ENDPOINTS=true/);
    assert.equal(ledgerPaymentsInDb(await text(part + "-tag")), 0);
  }
  await run("12");
  assert.match(await text("s12-inbox-note"), /DEMO_UNSAFE_ENDPOINTS=true/);
  await page.screenshot({ path: join(OUT, "lab-without-switches.png"), fullPage: true });
  await stop(plain.proc);
});
