// Shared by the Node.js test suites (tests/lab, tests/sdk/node): a real
// `oncepay serve` on a database of its own, psql for reading the database
// back, and a proxy that loses answers. No dependency beyond Node.js itself.

import { execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { createWriteStream, existsSync, mkdirSync, readFileSync } from "node:fs";
import { connect, createServer } from "node:net";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
export const BIN = process.env.ONCEPAY_BIN || join(ROOT, "target", "debug", "oncepay");
/** Any database of a server where the user may create databases. */
export const SERVER_URL =
  process.env.DATABASE_URL || "postgres://postgres@127.0.0.1:5432/postgres";

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Runs SQL on URL with psql and returns its unaligned output. */
export function psql(url, sql) {
  return execFileSync("psql", ["-X", "-w", "-Atq", "-v", "ON_ERROR_STOP=1", url, "-c", sql], {
    encoding: "utf8",
    stdio: ["ignore", "pipe", "pipe"],
  }).trim();
}

export function withDatabase(url, name) {
  const u = new URL(url);
  u.pathname = "/" + name;
  return u.toString();
}

/** A database of its own on SERVER_URL: `{ url, processorUrl, drop() }`. */
export function createDatabase(prefix) {
  const name = `${prefix}_${randomBytes(6).toString("hex")}`;
  psql(SERVER_URL, `CREATE DATABASE "${name}"`);
  return {
    name,
    url: withDatabase(SERVER_URL, name),
    // The card gateway a server embeds keeps its ledger beside it.
    processorUrl: withDatabase(SERVER_URL, `${name}_processor`),
    drop: () => {
      psql(SERVER_URL, `DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
      psql(SERVER_URL, `DROP DATABASE IF EXISTS "${name}_processor" WITH (FORCE)`);
    },
  };
}

/** The workshop's settings (scripts/lib/workshop.env), as scripts/workshop starts the server. */
export function workshopSettings() {
  const lines = readFileSync(join(ROOT, "scripts", "lib", "workshop.env"), "utf8").split("\n");
  const settings = lines.map((l) => l.trim()).filter((l) => l && !l.startsWith("#"));
  return Object.fromEntries(settings.map((l) => [l.slice(0, l.indexOf("=")), l.slice(l.indexOf("=") + 1)]));
}

/** A merchant key the server creates at start (`DEMO_API_KEY`). */
export const newApiKey = (tag) => `sk_test_${tag}${randomBytes(20).toString("hex")}`;

/** The port in the `addr` of the `oncepay listening` line of TEXT (text or JSON logs). */
function listeningPort(text) {
  const m = /oncepay listening.*?"?addr"?[=:]"?[^\s"]*:(\d+)/.exec(text);
  return m ? Number(m[1]) : 0;
}

/**
 * Starts `oncepay serve` on DATABASE_URL and PORT, its output in LOG_PATH,
 * and waits for /healthz. Returns `{ proc, base, port }`. Without a PORT the
 * server binds port 0 and says which it got (so no other process can take
 * it between choice and use); with one (a restart), a start that finds it
 * still taken (`Address already in use`) is tried again for up to 60 s.
 */
export async function serve({ databaseUrl, apiKey, logPath, env = {}, cwd, port: fixedPort }) {
  if (!existsSync(BIN)) throw new Error(`${BIN} is missing: run cargo build --bin oncepay first`);
  mkdirSync(dirname(logPath), { recursive: true });
  const deadline = Date.now() + 60_000;
  const log = createWriteStream(logPath);
  for (;;) {
    const started = await start(fixedPort || 0, deadline);
    if (started.proc) return started;
    if (!(fixedPort && started.output.includes("Address already in use") && Date.now() < deadline)) {
      throw new Error(`oncepay serve exited (${started.exited}); see ${logPath}`);
    }
    await sleep(200);
  }

  // One start; `{ proc, base, port }` once it answers, or `{ exited, output }`.
  async function start(port, deadline) {
    let output = "";
    const proc = spawn(BIN, ["serve"], {
      cwd: cwd || dirname(logPath), // away from the repository's .env
      env: {
        PATH: process.env.PATH,
        DATABASE_URL: databaseUrl,
        PORT: String(port),
        BIND_ADDR: "127.0.0.1",
        DEMO_API_KEY: apiKey,
        RUST_LOG: "info,sqlx=warn",
        ...env,
      },
      stdio: ["ignore", "pipe", "pipe"],
    });
    for (const stream of [proc.stdout, proc.stderr]) {
      stream.on("data", (chunk) => {
        output += chunk;
        log.write(chunk);
      });
    }
    proc.exited = null;
    proc.on("exit", (code, signal) => {
      proc.exited = signal || `code ${code}`;
    });
    try {
      for (;;) {
        if (proc.exited) return { exited: proc.exited, output };
        if (!port) port = listeningPort(output);
        if (port) {
          try {
            if ((await fetch(`http://127.0.0.1:${port}/healthz`)).ok) break;
          } catch (_) {
            // not listening yet
          }
        }
        if (Date.now() > deadline) throw new Error(`oncepay did not answer /healthz; see ${logPath}`);
        await sleep(100);
      }
    } catch (e) {
      proc.kill("SIGKILL");
      throw e;
    }
    return { proc, base: `http://127.0.0.1:${port}`, port };
  }
}

export const MODEL_BIN = process.env.ONCEPAY_MODEL_BIN || join(ROOT, "target", "debug", "oncepay-model");

/**
 * Stateright's explorer of the model's VARIANT (`oncepay-model serve`) on a
 * free port: `{ proc, base, counterexample }`, the last the explorer's
 * address of the variant's shortest counterexample.
 */
export async function explore(variant) {
  if (!existsSync(MODEL_BIN)) throw new Error(`${MODEL_BIN} is missing: run cargo build -p oncepay-model first`);
  const proc = spawn(MODEL_BIN, ["serve", variant, "--addr", "127.0.0.1:0"], { stdio: ["ignore", "pipe", "inherit"] });
  proc.on("exit", () => { proc.exited = true; });
  let out = "";
  for await (const chunk of proc.stdout) {
    out += chunk;
    const found = /(http:\/\/\S+\/)#\/steps\/[\d/]+/.exec(out);
    if (found) return { proc, base: found[1], counterexample: found[0] };
  }
  throw new Error(`oncepay-model serve ${variant} exited: ${out}`);
}

/** SIGTERM, then SIGKILL after 10 s. */
export async function stop(proc) {
  if (proc.exited) return;
  proc.kill("SIGTERM");
  for (let i = 0; i < 100 && !proc.exited; i++) await sleep(100);
  if (!proc.exited) proc.kill("SIGKILL");
}

/**
 * A TCP proxy to TARGET_PORT that can lose answers: after `loseNext()`, the
 * next bytes the server sends back are thrown away and the client's
 * connection is reset. The server has finished (and committed) the request
 * by then; only its answer is lost, as on a flaky network.
 */
export async function lossyProxy(targetPort) {
  let toLose = 0;
  const proxy = { lost: 0, port: 0, loseNext: (n = 1) => (toLose += n) };
  const sockets = new Set();
  const server = createServer((client) => {
    const upstream = connect(targetPort, "127.0.0.1");
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on("close", () => sockets.delete(s));
      s.on("error", () => {});
    }
    client.pipe(upstream);
    upstream.on("data", (chunk) => {
      if (toLose > 0) {
        toLose -= 1;
        proxy.lost += 1;
        client.resetAndDestroy();
        upstream.destroy();
      } else {
        client.write(chunk);
      }
    });
    upstream.on("end", () => client.end());
    client.on("close", () => upstream.destroy());
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  proxy.port = server.address().port;
  proxy.close = () =>
    new Promise((ok) => {
      for (const s of sockets) s.destroy();
      server.close(ok);
    });
  return proxy;
}
