"""A real `oncepay serve` for the Stripe SDK tests, on a database of its own.

The server runs with a short `PROCESSING_TIMEOUT`, so that a charge whose
outcome is unknown is recoverable within the SDK's retries, and with webhook
retries and polling of 100 ms, so that a failed delivery is sent again at
once. `lossy_proxy` stands between the SDK and the server and can lose the
next answer after the server has sent it, as a network would.
`webhook_receiver` is an HTTP server on 127.0.0.1 that keeps every delivery
it is sent, raw body and headers, and answers as the test tells it.

Settings (environment): DATABASE_URL (any database of a server where the
user may create databases), ONCEPAY_BIN (default target/debug/oncepay).
"""

import http.server
import json
import os
import re
import secrets
import socket
import struct
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "target" / "sdk"
BIN = Path(os.environ.get("ONCEPAY_BIN", ROOT / "target" / "debug" / "oncepay"))
SERVER_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
# Short, so that the SDK's own retries outlast a stale claim.
PROCESSING_TIMEOUT = "2s"
# Short, so that a delivery refused once is sent again within the test.
WEBHOOK_RETRY_BASE = "100ms"
WEBHOOK_POLL_INTERVAL = "100ms"


def psql(url, sql):
    """Runs SQL on URL with psql and returns its unaligned output."""
    return subprocess.run(
        ["psql", "-X", "-w", "-Atq", "-v", "ON_ERROR_STOP=1", url, "-c", sql],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def with_database(url, name):
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


def listening_port(log_path):
    """The port in the `addr` of the `oncepay listening` line of the server's
    log (text or JSON), or None yet: the server binds port 0 itself, so no
    other process can take its port between choice and use."""
    text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
    m = re.search(r'oncepay listening.*?"?addr"?[=:]"?[^\s"]*:(\d+)', text)
    return int(m.group(1)) if m else None


@dataclass
class Oncepay:
    base: str
    api_key: str
    db_url: str

    def sql(self, query):
        return psql(self.db_url, query)

    def count(self, query):
        return int(self.sql(query))

    def charges_tagged(self, tag):
        """Charges whose metadata carries `test=tag`."""
        return self.count(f"SELECT count(*) FROM charges WHERE metadata->>'test' = '{tag}'")

    def payments_tagged(self, tag):
        """Money moved at the processor for the charges tagged `tag`: the
        charges from oncepay's database, their payments from the card
        gateway's ledger (the server embeds it, in `<database>_processor`)."""
        keys = self.sql(
            "SELECT coalesce(string_agg(quote_literal('auth:' || id), ','), 'NULL') "
            f"FROM charges WHERE metadata->>'test' = '{tag}'"
        )
        return int(psql(
            self.db_url + "_processor",
            f"SELECT count(*) FROM operations WHERE outcome = 'succeeded' AND key IN ({keys})",
        ))


def serve(log_name, **settings):
    """Starts `oncepay serve` on a database of its own, with `settings` added
    to the environment; yields an `Oncepay`, then stops it and drops its
    databases."""
    assert BIN.exists(), f"{BIN} is missing: run cargo build --bin oncepay first"
    OUT.mkdir(parents=True, exist_ok=True)
    db_name = "oncepay_sdk_py_" + secrets.token_hex(6)
    psql(SERVER_URL, f'CREATE DATABASE "{db_name}"')
    db_url = with_database(SERVER_URL, db_name)
    api_key = "sk_test_sdkpy" + secrets.token_hex(20)
    log = open(OUT / log_name, "wb")
    server = subprocess.Popen(
        [str(BIN), "serve"],
        cwd=OUT,  # away from the repository's .env
        env={
            "PATH": os.environ["PATH"],
            "DATABASE_URL": db_url,
            "PORT": "0",
            "BIND_ADDR": "127.0.0.1",
            "DEMO_API_KEY": api_key,
            "PROCESSING_TIMEOUT": PROCESSING_TIMEOUT,
            "SWEEP_INTERVAL": "500ms",
            "WEBHOOK_RETRY_BASE": WEBHOOK_RETRY_BASE,
            "WEBHOOK_POLL_INTERVAL": WEBHOOK_POLL_INTERVAL,
            # The tests' webhook receivers listen on loopback.
            "WEBHOOK_ALLOW_PRIVATE": "true",
            "RUST_LOG": "info,sqlx=warn",
            **settings,
        },
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = None
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"oncepay serve exited; see {OUT}/{log_name}"
            port = listening_port(OUT / log_name)
            base = port and f"http://127.0.0.1:{port}"
            try:
                if base:
                    with urllib.request.urlopen(base + "/healthz", timeout=1) as r:
                        if r.status == 200:
                            break
            except OSError:
                pass
            assert time.monotonic() < deadline, "oncepay did not answer /healthz within 60 s"
            time.sleep(0.1)
        yield Oncepay(base=base, api_key=api_key, db_url=db_url)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        psql(SERVER_URL, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        psql(SERVER_URL, f'DROP DATABASE IF EXISTS "{db_name}_processor" WITH (FORCE)')


@pytest.fixture(scope="session")
def oncepay():
    yield from serve("python-server.log")


@pytest.fixture(scope="module")
def rate_limited_oncepay():
    """A server whose merchants may write once a second, one at a time."""
    yield from serve("python-limited-server.log", RATE_LIMIT_PER_SECOND="1", RATE_LIMIT_BURST="1")


class LossyProxy:
    """A TCP proxy that can lose answers: once armed with `lose_next()`, the
    next bytes the server sends back are thrown away and the client's
    connection is reset. The server has finished (and committed) the request
    by then; only its answer is lost, as on a flaky network."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.to_lose = 0
        self.lost = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_next(self, n=1):
        with self.lock:
            self.to_lose += n

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _take_loss(self):
        with self.lock:
            if self.to_lose > 0:
                self.to_lose -= 1
                self.lost += 1
                return True
            return False

    def _pipe(self, src, dst, answers):
        try:
            while data := src.recv(65536):
                if answers and self._take_loss():
                    # Reset, not close: the client sees the connection drop.
                    # Shutting down the reading side first wakes the other
                    # direction's thread, so that the socket really closes.
                    dst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    dst.shutdown(socket.SHUT_RD)
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self):
        self.listener.close()


@pytest.fixture
def lossy_proxy(oncepay):
    port = int(urllib.parse.urlsplit(oncepay.base).port)
    proxy = LossyProxy(port)
    yield proxy
    proxy.close()


@dataclass
class Delivery:
    """One webhook request as it arrived: the body's raw bytes, unparsed."""

    body: bytes
    signature: str
    content_type: str
    received_at: float
    event: dict = field(init=False)

    def __post_init__(self):
        self.event = json.loads(self.body)

    @property
    def timestamp(self):
        """The `t=` of its `Stripe-Signature`."""
        return int(dict(p.split("=", 1) for p in self.signature.split(","))["t"])


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that keeps every POST it is sent, in
    order, and answers each with the status `answer(delivery)` returns
    (200 unless the test sets another `answer`)."""

    def __init__(self):
        self.deliveries = []
        self.changed = threading.Condition()
        self.answer = lambda delivery: 200
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                delivery = Delivery(
                    body=body,
                    signature=self.headers.get("Stripe-Signature", ""),
                    content_type=self.headers.get("Content-Type", ""),
                    received_at=time.time(),
                )
                with receiver.changed:
                    receiver.deliveries.append(delivery)
                    receiver.changed.notify_all()
                status = receiver.answer(delivery)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/webhooks"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of_object(self, object_id, n=1, timeout=15):
        """The first N deliveries of events about OBJECT_ID (a charge or a
        refund), waiting for them."""

        def mine():
            return [d for d in self.deliveries if d.event["data"]["object"].get("id") == object_id]

        with self.changed:
            got = self.changed.wait_for(lambda: len(mine()) >= n, timeout)
            assert got, f"{len(mine())} of {n} deliveries about {object_id} within {timeout} s"
            return mine()[:n]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook_receiver():
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()
