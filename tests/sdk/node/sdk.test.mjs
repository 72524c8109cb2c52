// The official `stripe` npm package against a real oncepay: every call a
// charges integration makes, every error class it catches, and the SDK's own
// retries ending in exactly one charge, counted in the database; then the
// webhook endpoints it manages, and its own `webhooks.constructEvent`
// verifying what oncepay delivers to a receiver on 127.0.0.1.
//
// Run by scripts/test; alone:
//   cargo build --bin oncepay && (cd tests/sdk/node && npm ci) &&
//   DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres node --test tests/sdk/node/
//
// Settings (environment): DATABASE_URL (any database of a server where the
// user may create databases), ONCEPAY_BIN (default target/debug/oncepay).
// The server's log: target/sdk/node-server.log.

import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { randomBytes, randomUUID } from "node:crypto";
import { createServer } from "node:http";
import { join } from "node:path";
import Stripe from "stripe";
import {
  ROOT,
  createDatabase,
  lossyProxy,
  newApiKey,
  psql,
  serve,
  sleep,
  stop,
} from "../../support/oncepay.mjs";

let db = null;
let server = null;
let apiKey = null;

before(async () => {
  db = createDatabase("oncepay_sdk_node");
  apiKey = newApiKey("sdknode");
  server = await serve({
    databaseUrl: db.url,
    apiKey,
    logPath: join(ROOT, "target", "sdk", "node-server.log"),
    // Short, so that the SDK's own retries outlast a stale claim, and so
    // that a delivery refused once is sent again within the test.
    env: {
      PROCESSING_TIMEOUT: "2s",
      SWEEP_INTERVAL: "500ms",
      WEBHOOK_RETRY_BASE: "100ms",
      WEBHOOK_POLL_INTERVAL: "100ms",
      // The tests' webhook receivers listen on loopback.
      WEBHOOK_ALLOW_PRIVATE: "true",
    },
  });
});

after(async () => {
  if (server) await stop(server.proc);
  db?.drop();
});

/** An SDK pointed at oncepay (or at PORT, a proxy in front of it). */
function stripe({ port = server.port, key = apiKey, ...options } = {}) {
  return new Stripe(key, { host: "127.0.0.1", port, protocol: "http", ...options });
}

/** Charge parameters with a tag of their own, to count them in the database. */
function tagged(amount, source = "tok_visa") {
  const tag = "node-" + randomBytes(6).toString("hex");
  return [tag, { amount, currency: "usd", source, metadata: { test: tag } }];
}

const count = (sql) => Number(psql(db.url, sql));
const chargesTagged = (tag) =>
  count(`SELECT count(*) FROM charges WHERE metadata->>'test' = '${tag}'`);
/** Money moved at the processor for the charges tagged TAG. */
const paymentsTagged = (tag) => {
  // The charges from oncepay's database, their payments from the card
  // gateway's ledger beside it.
  const keys = psql(
    db.url,
    `SELECT coalesce(string_agg(quote_literal('auth:' || id), ','), 'NULL')
       FROM charges WHERE metadata->>'test' = '${tag}'`,
  );
  return Number(
    psql(db.processorUrl, `SELECT count(*) FROM operations WHERE outcome = 'succeeded' AND key IN (${keys})`),
  );
};

/** The error PROMISE rejects with, checked to be an instance of CLASS. */
async function rejection(promise, Class) {
  try {
    const value = await promise;
    assert.fail(`expected ${Class.name}, resolved with ${JSON.stringify(value)}`);
  } catch (e) {
    if (e instanceof assert.AssertionError) throw e;
    assert.ok(e instanceof Class, `expected ${Class.name}, got ${e.constructor.name}: ${e.message}`);
    return e;
  }
}

test("create then retrieve gives the same charge", async () => {
  const sdk = stripe();
  const [tag, params] = tagged(2000);
  const charge = await sdk.charges.create(params);
  assert.deepEqual(
    [charge.object, charge.status, charge.amount, charge.currency, charge.paid],
    ["charge", "succeeded", 2000, "usd", true],
  );
  assert.equal(charge.metadata.test, tag);
  assert.equal(charge.lastResponse.statusCode, 200, "a create is 200, as Stripe answers it");
  assert.equal(charge.lastResponse.requestId, charge.lastResponse.headers["request-id"]);
  const again = await sdk.charges.retrieve(charge.id);
  const { lastResponse: _a, ...created } = charge;
  const { lastResponse: _b, ...read } = again;
  assert.deepEqual(read, created);
  assert.equal(chargesTagged(tag), 1);
});

test("the same idempotency key gives the same charge once", async () => {
  const sdk = stripe();
  const [tag, params] = tagged(1500);
  const idempotencyKey = randomUUID();
  const first = await sdk.charges.create(params, { idempotencyKey });
  const second = await sdk.charges.create(params, { idempotencyKey });
  assert.equal(second.id, first.id);
  assert.equal(second.lastResponse.headers["idempotent-replayed"], "true");
  assert.equal(second.lastResponse.headers["idempotency-key"], idempotencyKey);
  assert.equal(second.lastResponse.headers["original-request"], first.lastResponse.requestId);
  assert.equal(second.lastResponse.statusCode, 200);
  assert.equal(chargesTagged(tag), 1);
  assert.equal(paymentsTagged(tag), 1);
});

test("auto-paging walks every charge forward and back", async () => {
  const sdk = stripe();
  const ids = [];
  for (let i = 0; i < 5; i++) ids.push((await sdk.charges.create(tagged(100 + i)[1])).id);
  const listed = [];
  for await (const c of sdk.charges.list({ limit: 2 })) listed.push(c.id);
  assert.deepEqual(listed.slice(0, 5), [...ids].reverse(), "the newest five, newest first");
  assert.equal(new Set(listed).size, listed.length);
  assert.equal(listed.length, count("SELECT count(*) FROM charges"));
  // From the oldest of the five back up to the newest: the SDK pages with
  // ending_before and yields the charges nearest the cursor first.
  const back = [];
  for await (const c of sdk.charges.list({ limit: 2, ending_before: ids[0] })) back.push(c.id);
  assert.deepEqual(back, ids.slice(1));
});

test("a partial then full refund, and the balance", async () => {
  const sdk = stripe();
  const usd = (b) => b.available.find((x) => x.currency === "usd")?.amount ?? 0;
  const before = await sdk.balance.retrieve();
  const charge = await sdk.charges.create(tagged(3000)[1]);
  const partial = await sdk.refunds.create({ charge: charge.id, amount: 1000 });
  assert.deepEqual(
    [partial.object, partial.status, partial.amount, partial.charge],
    ["refund", "succeeded", 1000, charge.id],
  );
  const rest = await sdk.refunds.create({ charge: charge.id });
  assert.equal(rest.amount, 2000);
  assert.equal((await sdk.refunds.retrieve(rest.id)).id, rest.id);
  const refunded = await sdk.charges.retrieve(charge.id);
  assert.deepEqual([refunded.amount_refunded, refunded.refunded], [3000, true]);
  const after = await sdk.balance.retrieve();
  assert.equal(after.object, "balance");
  assert.equal(usd(after), usd(before), "charged 3000, refunded 3000");
  assert.equal(count(`SELECT amount_refunded FROM charges WHERE id = '${charge.id}'`), 3000);
});

test("an authorized charge is captured once by racing captures with many keys", async () => {
  const [tag, params] = tagged(2000);
  const charge = await stripe().charges.create({ ...params, capture: false });
  assert.deepEqual([charge.paid, charge.captured, charge.amount_captured], [true, false, 0]);
  const answers = await Promise.allSettled(
    Array.from({ length: 8 }, (_, i) =>
      stripe({ maxNetworkRetries: 0 }).charges.capture(
        charge.id,
        { amount: 1200 },
        { idempotencyKey: `${tag}-${i}` },
      ),
    ),
  );
  const won = answers.filter((a) => a.status === "fulfilled");
  assert.equal(won.length, 1, "one capture wins");
  for (const lost of answers.filter((a) => a.status === "rejected")) {
    assert.ok(lost.reason instanceof Stripe.errors.StripeInvalidRequestError);
    assert.equal(lost.reason.code, "charge_already_captured");
  }
  const after = await stripe().charges.retrieve(charge.id);
  // The 800 not captured is released with no refund, as at Stripe since 2025-03-31.basil.
  assert.deepEqual(
    [after.captured, after.amount_captured, after.amount_refunded, after.refunds.data],
    [true, 1200, 0, []],
  );
  assert.equal(
    count(`SELECT count(*) FROM events WHERE object_id = '${charge.id}' AND type = 'charge.captured'`),
    1,
  );
});

test("a capture with no body and no Content-Type captures the whole amount", async () => {
  const charge = await stripe().charges.create({ ...tagged(7200)[1], capture: false });
  // `curl -X POST .../v1/charges/{id}/capture -u sk_...:`, as Stripe's docs
  // show it: basic auth, no body, no Content-Type.
  const answer = await fetch(`http://127.0.0.1:${server.port}/v1/charges/${charge.id}/capture`, {
    method: "POST",
    headers: { authorization: "Basic " + Buffer.from(`${apiKey}:`).toString("base64") },
  });
  assert.equal(answer.status, 200);
  const captured = await answer.json();
  assert.deepEqual([captured.captured, captured.amount_captured], [true, 7200]);
  const again = await stripe().charges.retrieve(charge.id);
  assert.deepEqual([again.captured, again.amount_captured, again.amount_refunded], [true, 7200, 0]);
  assert.equal(
    count(`SELECT count(*) FROM events WHERE object_id = '${charge.id}' AND type = 'charge.captured'`),
    1,
  );
});

test("updates merge and unset metadata, and a charge keeps its details", async () => {
  const sdk = stripe();
  const [tag, params] = tagged(2000);
  const charge = await sdk.charges.create({
    ...params,
    metadata: { test: tag, order: "1" },
    receipt_email: "jenny@example.com",
  });
  assert.equal(charge.receipt_email, "jenny@example.com");
  const updated = await sdk.charges.update(
    charge.id,
    { description: "Order 1", metadata: { order: "", note: "gift" } },
    { idempotencyKey: `${tag}-update` },
  );
  assert.equal(updated.description, "Order 1");
  assert.deepEqual(updated.metadata, { test: tag, note: "gift" });
  const refund = await sdk.refunds.create({ charge: charge.id, amount: 500 });
  const tagged_ = await sdk.refunds.update(refund.id, { metadata: { reason: "damaged" } });
  assert.deepEqual(tagged_.metadata, { reason: "damaged" });
  const endpoint = await sdk.webhookEndpoints.create({
    url: "http://127.0.0.1:9/hooks",
    enabled_events: ["charge.succeeded"],
  });
  try {
    const disabled = await sdk.webhookEndpoints.update(endpoint.id, { disabled: true });
    assert.equal(disabled.status, "disabled");
  } finally {
    await sdk.webhookEndpoints.del(endpoint.id);
  }
});

test("refunds are listed all, by charge, and through the charge's refunds URL", async () => {
  const sdk = stripe();
  const charge = await sdk.charges.create(tagged(3000)[1]);
  const other = await sdk.charges.create(tagged(3000)[1]);
  const first = await sdk.refunds.create({ charge: charge.id, amount: 1000 });
  const second = await sdk.refunds.create({ charge: charge.id, amount: 500 });
  const elsewhere = await sdk.refunds.create({ charge: other.id, amount: 100 });
  const byCharge = await sdk.refunds.list({ charge: charge.id });
  assert.deepEqual(
    byCharge.data.map((r) => [r.object, r.id]),
    [["refund", second.id], ["refund", first.id]],
  );
  const every = [];
  for await (const r of sdk.refunds.list({ limit: 1 })) every.push(r.id);
  assert.deepEqual(every.slice(0, 3), [elsewhere.id, second.id, first.id], "newest first");
  assert.equal(new Set(every).size, every.length);
  assert.equal(every.length, count("SELECT count(*) FROM refunds"));
  // The charge's refunds, read from the URL the charge gives for them.
  const { url } = (await sdk.charges.retrieve(charge.id)).refunds;
  assert.equal(url, `/v1/charges/${charge.id}/refunds`);
  const viaCharge = await sdk.rawRequest("GET", `${url}?limit=1`, null);
  assert.deepEqual([viaCharge.data.map((r) => r.id), viaCharge.has_more], [[second.id], true]);
  const one = await sdk.rawRequest("GET", `${url}/${first.id}`, null);
  assert.deepEqual(one.id, first.id);
  await assert.rejects(sdk.refunds.list({ charge: "ch_nope" }), (err) => {
    assert.ok(err instanceof Stripe.errors.StripeInvalidRequestError);
    assert.deepEqual([err.statusCode, err.code, err.param], [400, "resource_missing", "charge"]);
    return true;
  });
});

test("a created[gte] filter lists what was created in its seconds", async () => {
  const sdk = stripe();
  const old = await sdk.charges.create(tagged(100)[1]);
  const recent = await sdk.charges.create(tagged(100)[1]);
  const refund = await sdk.refunds.create({ charge: old.id });
  // Created in 2001, as far as the lists know.
  const moved = count(
    "WITH c AS (UPDATE charges SET created_at = to_timestamp(1000000000.5) " +
      `WHERE id = '${old.id}' RETURNING 1) SELECT count(*) FROM c`,
  );
  assert.equal(moved, 1);
  const since = [];
  for await (const c of sdk.charges.list({ created: { gte: recent.created } })) since.push(c.id);
  assert.ok(since.includes(recent.id) && !since.includes(old.id));
  const until = await sdk.charges.list({ created: { lte: 1000000000 } });
  assert.deepEqual(until.data.map((c) => c.id), [old.id]);
  const refunds = await sdk.refunds.list({ charge: old.id, created: { gte: refund.created } });
  assert.deepEqual(refunds.data.map((r) => r.id), [refund.id]);
  await assert.rejects(sdk.charges.list({ created: { gte: "soon" } }), (err) => {
    assert.deepEqual([err.code, err.param], ["parameter_invalid_integer", "created[gte]"]);
    return true;
  });
});

for (const [source, code, declineCode, param] of [
  ["tok_chargeDeclined", "card_declined", "generic_decline", undefined],
  ["tok_chargeDeclinedInsufficientFunds", "card_declined", "insufficient_funds", undefined],
  ["pm_card_chargeDeclinedInsufficientFunds", "card_declined", "insufficient_funds", undefined],
  ["tok_chargeDeclinedExpiredCard", "expired_card", undefined, "exp_month"],
  ["tok_chargeDeclinedIncorrectCvc", "incorrect_cvc", undefined, "cvc"],
  ["tok_chargeDeclinedProcessingError", "processing_error", undefined, undefined],
]) {
  test(`a decline (${source}) throws StripeCardError with its codes and charge`, async () => {
    const [tag, params] = tagged(500, source);
    const e = await rejection(stripe().charges.create(params), Stripe.errors.StripeCardError);
    assert.deepEqual(
      [e.statusCode, e.rawType, e.code, e.decline_code, e.param],
      // The SDK reads a missing decline_code as "".
      [402, "card_error", code, declineCode ?? "", param],
    );
    assert.equal(e.doc_url, `https://stripe.com/docs/error-codes/${code.replaceAll("_", "-")}`);
    assert.match(e.charge, /^ch_/);
    assert.ok(e.requestId);
    assert.equal(e.headers["stripe-should-retry"], "false");
    assert.equal(psql(db.url, `SELECT status FROM charges WHERE id = '${e.charge}'`), "failed");
    assert.equal(paymentsTagged(tag), 0);
  });
}

for (const [params, code, param] of [
  [{ currency: "usd", source: "tok_visa" }, "parameter_missing", "amount"],
  [{ amount: 0, currency: "usd", source: "tok_visa" }, "parameter_invalid_integer", "amount"],
  [{ amount: 5, currency: "usd", source: "tok_visa" }, "amount_too_small", "amount"],
  [{ amount: 100, currency: "usx", source: "tok_visa" }, "invalid_currency", "currency"],
  [{ amount: 100, currency: "usd", source: "tok_nope" }, "resource_missing", "source"],
  [{ amount: 100, currency: "usd", source: "tok_visa", colour: "red" }, "parameter_unknown", "colour"],
  [
    { amount: 100, currency: "usd", source: "tok_visa", expand: ["balance_transaction"] },
    "property_not_expandable",
    "expand",
  ],
]) {
  test(`bad parameters (${code}) throw StripeInvalidRequestError naming ${param}`, async () => {
    const before = count("SELECT count(*) FROM charges");
    const e = await rejection(stripe().charges.create(params), Stripe.errors.StripeInvalidRequestError);
    assert.deepEqual([e.statusCode, e.rawType, e.code, e.param], [400, "invalid_request_error", code, param]);
    assert.equal(count("SELECT count(*) FROM charges"), before, "nothing written");
  });
}

test("an unknown route throws StripeInvalidRequestError 404", async () => {
  const e = await rejection(
    stripe().paymentIntents.create({ amount: 2000, currency: "usd" }),
    Stripe.errors.StripeInvalidRequestError,
  );
  assert.deepEqual([e.statusCode, e.rawType], [404, "invalid_request_error"]);
  assert.match(e.message, /^Unrecognized request URL \(POST: \/v1\/payment_intents\)\./);
});

test("a card of each new brand pays", async () => {
  const sdk = stripe();
  for (const [source, brand, last4] of [
    ["tok_jcb", "jcb", "0505"],
    ["tok_unionpay", "unionpay", "0005"],
    ["tok_diners", "diners", "0004"],
    ["pm_card_mastercard_prepaid", "mastercard", "5100"],
  ]) {
    const charge = await sdk.charges.create(tagged(2000, source)[1]);
    const card = charge.payment_method_details.card;
    assert.deepEqual([charge.status, card.brand, card.last4], ["succeeded", brand, last4], source);
  }
  const risky = await sdk.charges.create(tagged(2000, "tok_riskLevelElevated")[1]);
  assert.deepEqual(
    [risky.status, risky.outcome.risk_level, risky.outcome.type],
    ["succeeded", "elevated", "manual_review"],
  );
});

test("an unknown charge throws StripeInvalidRequestError 404", async () => {
  const e = await rejection(
    stripe().charges.retrieve("ch_doesnotexist"),
    Stripe.errors.StripeInvalidRequestError,
  );
  assert.deepEqual([e.statusCode, e.code, e.param], [404, "resource_missing", "id"]);
});

test("a wrong API key throws StripeAuthenticationError", async () => {
  const e = await rejection(
    stripe({ key: "sk_test_" + "0".repeat(40) }).charges.list(),
    Stripe.errors.StripeAuthenticationError,
  );
  assert.deepEqual([e.statusCode, e.code], [401, "invalid_api_key"]);
});

test("an over-refund throws StripeInvalidRequestError and refunds nothing", async () => {
  const sdk = stripe();
  const charge = await sdk.charges.create(tagged(1000)[1]);
  const e = await rejection(
    sdk.refunds.create({ charge: charge.id, amount: 1001 }),
    Stripe.errors.StripeInvalidRequestError,
  );
  assert.deepEqual([e.statusCode, e.code, e.param], [400, "amount_too_large", "amount"]);
  assert.equal(count(`SELECT count(*) FROM refunds WHERE charge_id = '${charge.id}'`), 0);
  assert.equal(count(`SELECT amount_refunded FROM charges WHERE id = '${charge.id}'`), 0);
});

test("a reused key throws StripeIdempotencyError and charges once", async () => {
  const sdk = stripe();
  const [tag, params] = tagged(700);
  const idempotencyKey = randomUUID();
  await sdk.charges.create(params, { idempotencyKey });
  const e = await rejection(
    sdk.charges.create({ ...params, amount: 701 }, { idempotencyKey }),
    Stripe.errors.StripeIdempotencyError,
  );
  assert.deepEqual([e.statusCode, e.rawType, e.code], [400, "idempotency_error", "idempotency_key_reused"]);
  assert.equal(e.headers["stripe-should-retry"], "false");
  assert.equal(chargesTagged(tag), 1);
});

test("a processor outage throws StripeAPIError and moves no money", async () => {
  const [tag, params] = tagged(900, "tok_processorUnavailable");
  const e = await rejection(
    stripe({ maxNetworkRetries: 0 }).charges.create(params),
    Stripe.errors.StripeAPIError,
  );
  assert.deepEqual([e.statusCode, e.rawType, e.code], [503, "api_error", "processor_unavailable"]);
  assert.equal(e.headers["stripe-should-retry"], "true");
  assert.equal(paymentsTagged(tag), 0);
});

test("a duplicate in flight throws StripeAPIError 409 that asks for a retry", async () => {
  const sdk = stripe({ maxNetworkRetries: 0 });
  const [tag, params] = tagged(800, "tok_processorTimeoutAfterCapture");
  const idempotencyKey = randomUUID();
  const first = await rejection(sdk.charges.create(params, { idempotencyKey }), Stripe.errors.StripeAPIError);
  assert.deepEqual([first.statusCode, first.code], [503, "processing_outcome_unknown"]);
  // The key stays claimed until recovery settles the charge. The SDK makes
  // an API error of a 409 (by its status), and retries it when it may.
  const e = await rejection(sdk.charges.create(params, { idempotencyKey }), Stripe.errors.StripeAPIError);
  assert.deepEqual([e.statusCode, e.code], [409, "idempotency_key_in_use"]);
  assert.equal(e.headers["stripe-should-retry"], "true");
  assert.ok(Number(e.headers["retry-after"]) >= 1);
  assert.equal(chargesTagged(tag), 1);
});

test("SDK retries through a lost answer make one charge", async () => {
  const proxy = await lossyProxy(server.port);
  try {
    // No key given: the SDK makes one up for every POST and sends it again
    // on each retry. The first answer is lost after the charge committed.
    const sdk = stripe({ port: proxy.port, maxNetworkRetries: 2 });
    const [tag, params] = tagged(1200);
    proxy.loseNext();
    const charge = await sdk.charges.create(params);
    assert.equal(proxy.lost, 1, "the first answer was lost");
    assert.equal(charge.status, "succeeded");
    assert.equal(charge.lastResponse.headers["idempotent-replayed"], "true", "the retry was a replay");
    assert.equal(chargesTagged(tag), 1);
    assert.equal(paymentsTagged(tag), 1);
    const key = psql(db.url, `SELECT key FROM idempotency_keys WHERE charge_id = '${charge.id}'`);
    assert.match(key, /^stripe-node-retry-[0-9a-f-]{36}$/, "the SDK's own key, unquoted");
  } finally {
    await proxy.close();
  }
});

test("even with retries off, the SDK retries a reset connection once, and the key makes it one charge", async () => {
  const proxy = await lossyProxy(server.port);
  try {
    // stripe-node retries a connection closed by the peer (ECONNRESET) once
    // whatever maxNetworkRetries says; without a key that is a second charge.
    const sdk = stripe({ port: proxy.port, maxNetworkRetries: 0 });
    const [tag, params] = tagged(1300);
    proxy.loseNext();
    const charge = await sdk.charges.create(params);
    assert.equal(proxy.lost, 1);
    assert.equal(charge.lastResponse.headers["idempotent-replayed"], "true");
    assert.equal(chargesTagged(tag), 1);
    assert.equal(paymentsTagged(tag), 1);
  } finally {
    await proxy.close();
  }
});

test("SDK retries through processing_outcome_unknown make one succeeded charge", async () => {
  // The processor captures, then times out: 503 processing_outcome_unknown,
  // then 409 while the key is claimed, then, once the claim is stale, the
  // retry settles the charge from the processor's record and answers it.
  const sdk = stripe({ maxNetworkRetries: 8 });
  const [tag, params] = tagged(1400, "tok_processorTimeoutAfterCapture");
  const charge = await sdk.charges.create(params);
  assert.deepEqual([charge.status, charge.amount], ["succeeded", 1400]);
  assert.equal(chargesTagged(tag), 1);
  assert.equal(paymentsTagged(tag), 1);
});

test("the SDK retries a 429 (Stripe-Should-Retry) until admitted, and each charge is made once", async () => {
  // A server of its own on the same database, whose merchants may write
  // once a second, one request at a time.
  const key = newApiKey("sdknodelimited");
  const limited = await serve({
    databaseUrl: db.url,
    apiKey: key,
    logPath: join(ROOT, "target", "sdk", "node-limited-server.log"),
    env: { RATE_LIMIT_PER_SECOND: "1", RATE_LIMIT_BURST: "1" },
  });
  try {
    const refused = async () => {
      const text = await (await fetch(limited.base + "/metrics")).text();
      const line = text.split("\n").find((l) => l.startsWith('rate_limited_total{kind="write"}'));
      return Number(line.split(" ").at(-1));
    };
    const without = stripe({ port: limited.port, key, maxNetworkRetries: 0 });
    const [firstTag, first] = tagged(1500);
    await without.charges.create(first);
    const [refusedTag, params] = tagged(1600);
    const e = await rejection(without.charges.create(params), Stripe.errors.StripeRateLimitError);
    assert.deepEqual([e.statusCode, e.code], [429, "rate_limit"]);
    assert.ok(Number(e.headers["retry-after"]) >= 1, "Retry-After");
    assert.equal(e.headers["stripe-should-retry"], "true");
    assert.deepEqual([chargesTagged(firstTag), chargesTagged(refusedTag)], [1, 0]);

    const before = await refused();
    const sdk = stripe({ port: limited.port, key, maxNetworkRetries: 3 });
    const tags = [];
    for (const amount of [1700, 1800, 1900]) {
      const [tag, p] = tagged(amount);
      tags.push(tag);
      const charge = await sdk.charges.create(p);
      assert.deepEqual([charge.amount, charge.status], [amount, "succeeded"]);
    }
    assert.ok((await refused()) > before, "some were answered 429 first");
    assert.deepEqual(tags.map(chargesTagged), [1, 1, 1]);
  } finally {
    await stop(limited.proc);
  }
});

// Webhooks.

/**
 * An HTTP server on 127.0.0.1 that keeps every POST it is sent, in order,
 * the body as the raw bytes that arrived, and answers each with the status
 * `answer(delivery)` gives (200 unless the test sets another `answer`).
 */
async function webhookReceiver() {
  const receiver = { deliveries: [], answer: () => 200 };
  const server = createServer((req, res) => {
    const chunks = [];
    req.on("data", (chunk) => chunks.push(chunk));
    req.on("end", async () => {
      const body = Buffer.concat(chunks);
      const signature = req.headers["stripe-signature"] ?? "";
      const delivery = {
        body,
        signature,
        contentType: req.headers["content-type"] ?? "",
        event: JSON.parse(body),
        /** The `t=` of its Stripe-Signature. */
        timestamp: Number(/(?:^|,)t=(\d+)/.exec(signature)?.[1]),
      };
      receiver.deliveries.push(delivery);
      const status = await receiver.answer(delivery);
      res.writeHead(status, { "content-length": 0 }).end();
    });
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  receiver.url = `http://127.0.0.1:${server.address().port}/webhooks`;
  /** The first N deliveries of events about OBJECT_ID (a charge or a refund), waiting for them. */
  receiver.ofObject = async (objectId, n = 1, timeoutMs = 15_000) => {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const mine = receiver.deliveries.filter((d) => d.event.data?.object?.id === objectId);
      if (mine.length >= n) return mine.slice(0, n);
      if (Date.now() > deadline) {
        assert.fail(`${mine.length} of ${n} deliveries about ${objectId} within ${timeoutMs} ms`);
      }
      await sleep(20);
    }
  };
  receiver.close = () =>
    new Promise((ok) => {
      server.closeAllConnections();
      server.close(ok);
    });
  return receiver;
}

/**
 * Runs FN with a receiver and an endpoint for `charge.succeeded` created
 * at it with the SDK; deletes the endpoint and stops the receiver after.
 */
async function withEndpoint(fn) {
  const receiver = await webhookReceiver();
  const sdk = stripe();
  try {
    const endpoint = await sdk.webhookEndpoints.create({
      url: receiver.url,
      enabled_events: ["charge.succeeded"],
    });
    try {
      return await fn({ sdk, receiver, endpoint });
    } finally {
      await sdk.webhookEndpoints.del(endpoint.id);
    }
  } finally {
    await receiver.close();
  }
}

/** A new charge, and the first N deliveries of its event. */
async function chargeAndDeliveries(sdk, receiver, n = 1) {
  const charge = await sdk.charges.create({ amount: 2000, currency: "usd", source: "tok_visa" });
  return [charge, await receiver.ofObject(charge.id, n)];
}

const withoutResponse = ({ lastResponse: _, ...object }) => object;

/** The error FN throws, checked to be a StripeSignatureVerificationError. */
function refused(fn) {
  try {
    fn();
  } catch (e) {
    assert.ok(
      e instanceof Stripe.errors.StripeSignatureVerificationError,
      `expected StripeSignatureVerificationError, got ${e.constructor.name}: ${e.message}`,
    );
    return e;
  }
  assert.fail("expected StripeSignatureVerificationError, the signature verified");
}

test("an endpoint shows its secret only when created, and is retrieved, listed and deleted", async () => {
  const receiver = await webhookReceiver();
  try {
    const sdk = stripe();
    const created = await sdk.webhookEndpoints.create({
      url: receiver.url,
      enabled_events: ["charge.succeeded"],
      description: "the Node.js SDK's receiver",
    });
    assert.match(created.id, /^we_/);
    assert.match(created.secret, /^whsec_/);
    assert.deepEqual(
      [created.object, created.url, created.enabled_events, created.status, created.description],
      ["webhook_endpoint", receiver.url, ["charge.succeeded"], "enabled", "the Node.js SDK's receiver"],
    );

    const retrieved = await sdk.webhookEndpoints.retrieve(created.id);
    assert.equal("secret" in retrieved, false);
    const { secret: _, ...shown } = withoutResponse(created);
    assert.deepEqual(withoutResponse(retrieved), shown);

    const listed = [];
    for await (const e of sdk.webhookEndpoints.list()) listed.push(e);
    assert.ok(listed.some((e) => e.id === created.id));
    assert.ok(listed.every((e) => e.object === "webhook_endpoint" && !("secret" in e)));

    const deleted = await sdk.webhookEndpoints.del(created.id);
    assert.deepEqual(
      [deleted.id, deleted.object, deleted.deleted],
      [created.id, "webhook_endpoint", true],
    );
    const e = await rejection(
      sdk.webhookEndpoints.retrieve(created.id),
      Stripe.errors.StripeInvalidRequestError,
    );
    assert.deepEqual([e.statusCode, e.code], [404, "resource_missing"]);
    const after = [];
    for await (const e of sdk.webhookEndpoints.list()) after.push(e.id);
    assert.equal(after.includes(created.id), false);
  } finally {
    await receiver.close();
  }
});

test("a charge is delivered signed, and constructEvent gives the event the API shows", async () => {
  await withEndpoint(async ({ sdk, receiver, endpoint }) => {
    const [charge, [delivery]] = await chargeAndDeliveries(sdk, receiver);
    assert.match(delivery.contentType, /^application\/json/);
    const event = sdk.webhooks.constructEvent(delivery.body, delivery.signature, endpoint.secret);
    assert.deepEqual([event.object, event.type], ["event", "charge.succeeded"]);
    assert.equal(event.data.object.id, charge.id);
    assert.deepEqual(event.data.object, withoutResponse(charge), "the charge as the API answered it");

    const retrieved = await sdk.events.retrieve(event.id);
    assert.deepEqual([retrieved.id, retrieved.type], [event.id, event.type]);
    assert.deepEqual(retrieved.data, event.data);
  });
});

/** Runs FN with one genuine delivery, checked to verify, and its endpoint's secret. */
async function withDelivery(fn) {
  await withEndpoint(async ({ sdk, receiver, endpoint }) => {
    const [, [delivery]] = await chargeAndDeliveries(sdk, receiver);
    sdk.webhooks.constructEvent(delivery.body, delivery.signature, endpoint.secret);
    await fn({ sdk, delivery, secret: endpoint.secret });
  });
}

test("constructEvent refuses a tampered payload", async () => {
  await withDelivery(async ({ sdk, delivery: { body, signature }, secret }) => {
    const tampered = Buffer.from(body.toString("utf8").replace('"amount":2000', '"amount":1'));
    assert.notDeepEqual(tampered, body);
    const e = refused(() => sdk.webhooks.constructEvent(tampered, signature, secret));
    assert.match(e.message, /No signatures found matching/);
    // Only the bytes as sent verify: the same JSON written again does not.
    const rewritten = JSON.stringify(JSON.parse(body), null, 2);
    const again = refused(() => sdk.webhooks.constructEvent(rewritten, signature, secret));
    assert.match(again.message, /No signatures found matching/);
  });
});

test("constructEvent refuses a delivery checked with another secret", async () => {
  await withDelivery(async ({ sdk, delivery: { body, signature } }) => {
    const other = "whsec_" + randomBytes(16).toString("hex");
    const e = refused(() => sdk.webhooks.constructEvent(body, signature, other));
    assert.match(e.message, /No signatures found matching/);
  });
});

test("constructEvent refuses a delivery older than its tolerance", async () => {
  await withDelivery(async ({ sdk, delivery: { body, signature, timestamp }, secret }) => {
    // Received later (constructEvent's receivedAt): at 300 s, the default
    // tolerance, the signature still holds; at 301 s it is stale.
    const receivedAfter = (seconds, tolerance = undefined) => {
      const receivedAt = (timestamp + seconds) * 1000;
      return sdk.webhooks.constructEvent(body, signature, secret, tolerance, undefined, receivedAt);
    };
    receivedAfter(300);
    assert.match(refused(() => receivedAfter(301)).message, /outside the tolerance zone/);
    assert.match(refused(() => receivedAfter(61, 60)).message, /outside the tolerance zone/);
  });
});

test("a delivery answered 500 is sent again signed anew, and the deliveries API shows both attempts", async () => {
  await withEndpoint(async ({ sdk, receiver, endpoint }) => {
    const failedOnce = new Set();
    receiver.answer = async (delivery) => {
      if (failedOnce.has(delivery.event.id)) return 200;
      failedOnce.add(delivery.event.id);
      // Not before the signature's second has passed, so that the retry is
      // signed at a later `t=`.
      while (Date.now() < (delivery.timestamp + 1) * 1000) await sleep(50);
      return 500;
    };
    const [charge, [first, second]] = await chargeAndDeliveries(sdk, receiver, 2);
    const events = [first, second].map((d) =>
      sdk.webhooks.constructEvent(d.body, d.signature, endpoint.secret),
    );
    assert.equal(events[1].id, events[0].id);
    assert.deepEqual(events.map((e) => e.type), ["charge.succeeded", "charge.succeeded"]);
    assert.equal(events[1].data.object.id, charge.id);
    assert.ok(second.timestamp > first.timestamp, "each attempt is signed when it is sent");

    // The worker records the second attempt once the receiver has answered it.
    const eventId = events[0].id;
    const deadline = Date.now() + 15_000;
    let mine;
    for (;;) {
      const answer = await fetch(`${server.base}/v1/events/${eventId}/deliveries`, {
        headers: { authorization: `Bearer ${apiKey}` },
      });
      assert.equal(answer.status, 200);
      mine = (await answer.json()).data.filter((d) => d.webhook_endpoint === endpoint.id);
      if (mine.length && mine[0].status !== "pending") break;
      assert.ok(Date.now() < deadline, `the delivery is still pending: ${JSON.stringify(mine)}`);
      await sleep(100);
    }
    const [delivery] = mine;
    assert.deepEqual(
      [delivery.object, delivery.event, delivery.url, delivery.status, delivery.attempt_count],
      ["webhook_delivery", eventId, receiver.url, "succeeded", 2],
    );
    assert.deepEqual(delivery.attempts.map((a) => a.attempt), [1, 2]);
    assert.deepEqual(delivery.attempts.map((a) => a.response_status), [500, 200]);
    assert.equal(delivery.attempts[0].error, "HTTP 500");
    assert.equal(receiver.deliveries.filter((d) => d.event.id === eventId).length, 2, "and no more");
  });
});

test("an endpoint for Stripe's refund.created is sent each refund, and the events list by it", async () => {
  const receiver = await webhookReceiver();
  const sdk = stripe();
  try {
    const endpoint = await sdk.webhookEndpoints.create({
      url: receiver.url,
      enabled_events: ["refund.created", "charge.refund.updated"],
    });
    try {
      assert.deepEqual(endpoint.enabled_events, ["charge.refund.updated", "refund.created"]);
      const charge = await sdk.charges.create({ amount: 2000, currency: "usd", source: "tok_visa" });
      const refund = await sdk.refunds.create({ charge: charge.id, amount: 500 });
      const [delivery] = await receiver.ofObject(refund.id);
      const event = sdk.webhooks.constructEvent(delivery.body, delivery.signature, endpoint.secret);
      assert.deepEqual([event.type, event.data.object.object], ["refund.created", "refund"]);
      assert.deepEqual(event.data.object, withoutResponse(refund), "the refund as the API answered it");
      const listed = await sdk.events.list({ type: "refund.created" });
      assert.ok(listed.data.some((e) => e.id === event.id));
      assert.ok(listed.data.every((e) => e.type === "refund.created"));
    } finally {
      await sdk.webhookEndpoints.del(endpoint.id);
    }
  } finally {
    await receiver.close();
  }
  const e = await rejection(
    sdk.events.list({ type: "refund.succeeded" }),
    Stripe.errors.StripeInvalidRequestError,
  );
  assert.deepEqual([e.statusCode, e.code, e.param], [400, "invalid_event_type", "type"]);
});
