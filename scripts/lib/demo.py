#!/usr/bin/env python3
"""The workshop demo: six scenarios against a running oncepay server.

Run by scripts/demo (which starts a server first, or uses ONCEPAY_URL); it can
also be run on its own:

    ONCEPAY_API_KEY=sk_test_... python3 scripts/lib/demo.py --url http://127.0.0.1:8080 [--json]

Every effect count printed is read from the server's GET /demo/effects (the
processor's payments in the database) after the scenario, never counted here;
scenario 6's shipments and deliveries from GET /demo/receivers (the workshop's
webhook receivers' tables). Each scenario tags its charges with a fresh run tag
(metadata demo_run) and uses fresh idempotency keys, so every run gives the
same numbers.

Python 3 standard library only. Exit status: 0 when every count is as
expected, 1 when one differs or a scenario could not run, 2 when the server
cannot be used at all.
"""

import argparse
import http.client
import json
import os
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

TIMEOUT = 30  # seconds, per request
DELIVERY_WAIT = 60  # seconds, for scenario 6's webhook deliveries to end


class Unusable(Exception):
    """The server cannot be used for the demo at all."""


# ----------------------------------------------------------------------------
# HTTP


class Answer:
    """What the client got for one request."""

    def __init__(self, status=None, body=None, replayed=False):
        self.status = status  # None: the connection closed with no answer
        self.body = body if isinstance(body, dict) else {}
        self.replayed = replayed

    @property
    def charge_id(self):
        return self.body.get("id") if self.status == 201 else None


class Server:
    def __init__(self, url, key):
        self.url = url.rstrip("/")
        self.key = key

    def request(self, method, path, body=None, headers=None, auth=True):
        """Sends one request. A connection closed without an answer is an
        Answer with status None; a server that cannot be reached is Unusable."""
        data = None
        all_headers = {"Accept": "application/json"}
        if auth:
            all_headers["Authorization"] = "Bearer " + self.key
        if body is not None:
            data = json.dumps(body).encode()
            all_headers["Content-Type"] = "application/json"
        all_headers.update(headers or {})
        req = urllib.request.Request(self.url + path, data=data, headers=all_headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as response:
                return self._answer(response.status, response.headers, response.read())
        except urllib.error.HTTPError as e:
            return self._answer(e.code, e.headers, e.read())
        except (http.client.RemoteDisconnected, http.client.IncompleteRead, ConnectionResetError):
            return Answer()  # the lost answer: the request ran, nothing came back
        except urllib.error.URLError as e:
            if isinstance(e.reason, (ConnectionResetError, http.client.RemoteDisconnected)):
                return Answer()
            raise Unusable(f"cannot reach {self.url}: {e.reason}") from None
        except (socket.timeout, TimeoutError):
            raise Unusable(f"{method} {path} got no answer within {TIMEOUT} s") from None

    @staticmethod
    def _answer(status, headers, raw):
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        replayed = (headers.get("Idempotent-Replayed") or "").lower() == "true"
        return Answer(status, body, replayed)

    def charge(self, run, key=None, fault=None, path="/v1/charges"):
        headers = {}
        if key is not None:
            headers["Idempotency-Key"] = key
        if fault is not None:
            headers["Oncepay-Fault"] = fault
        body = {"amount": 500, "currency": "usd", "source": "tok_visa", "metadata": {"demo_run": run}}
        return self.request("POST", path, body, headers)

    def create_endpoint(self, url, events):
        """A webhook endpoint; returns its answer (with `secret`, shown once)."""
        body = {"url": url, "enabled_events": events}
        return self.request("POST", "/v1/webhook_endpoints", body, {"Idempotency-Key": "demo-" + str(uuid.uuid4())})

    def set_up_receiver(self, run, mode, secret, fail_first):
        body = {"run": run, "mode": mode, "secret": secret, "fail_first": fail_first}
        return self.request("POST", "/demo/receivers", body)

    def receivers(self, run):
        """What RUN's webhook receivers took in: deliveries, events, shipments."""
        answer = self.request("GET", "/demo/receivers?run=" + urllib.parse.quote(run))
        if answer.status != 200 or "receivers" not in answer.body:
            raise Unusable(f"GET /demo/receivers answered {describe_problem(answer)}")
        return answer.body["receivers"]

    def event_of(self, charge_id, kind):
        """The event of type KIND about the charge, from the newest events."""
        answer = self.request("GET", "/v1/events?limit=100&type=" + urllib.parse.quote(kind))
        if answer.status != 200:
            raise Unusable(f"GET /v1/events answered {describe_problem(answer)}")
        for event in answer.body.get("data", []):
            if event.get("data", {}).get("object", {}).get("id") == charge_id:
                return event["id"]
        return None

    def deliveries(self, event_id):
        answer = self.request("GET", f"/v1/events/{urllib.parse.quote(event_id)}/deliveries")
        if answer.status != 200:
            raise Unusable(f"GET /v1/events/{event_id}/deliveries answered {describe_problem(answer)}")
        return answer.body.get("data", [])

    def effects(self, run):
        """Payments the processor recorded for the charges tagged RUN."""
        answer = self.request("GET", "/demo/effects?run=" + urllib.parse.quote(run))
        if answer.status != 200 or "payments" not in answer.body:
            raise Unusable(f"GET /demo/effects answered {describe_problem(answer)}")
        return int(answer.body["payments"])


def attempt_answer(attempt):
    """What one webhook attempt got: the status code, or why none came."""
    if attempt.get("response_status") is not None:
        return str(attempt["response_status"])
    return attempt.get("error") or "no answer"


def describe_problem(answer):
    if answer.status is None:
        return "nothing (the connection closed)"
    code = answer.body.get("code")
    return f"{answer.status}" + (f" {code}" if code else "")


def at_once(*calls):
    """Runs the calls in threads released together by a barrier; returns
    their answers in the order given."""
    barrier = threading.Barrier(len(calls))
    answers = [None] * len(calls)
    errors = []

    def run(i, call):
        try:
            barrier.wait()
            answers[i] = call()
        except Exception as e:  # reported after the join
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return answers


# ----------------------------------------------------------------------------
# The scenarios


class Block:
    """One titled block: rows of (part, name, value), the effect counts read
    from the database, and the counts expected."""

    def __init__(self, number, title):
        self.number = number
        self.title = title
        self.rows = []
        self.effects = {}
        self.expected = {}
        self.runs = []
        self.skipped = None
        self._part = None
        self._numbers = {}  # charge id -> #n, in order of first appearance

    def part(self, heading):
        self._part = heading

    def row(self, name, value):
        self.rows.append((self._part, name, value))

    def count(self, name, value, expected):
        self.effects[name] = value
        self.expected[name] = expected
        return value

    def say(self, answer):
        """What the client got, in the words of the workshop: `ok #n`, `ok #n
        (replayed)`, `in use (409)`, `empty answer`, else status and code."""
        if answer.status is None:
            return "empty answer"
        if answer.status == 201 and answer.charge_id:
            n = self._numbers.setdefault(answer.charge_id, len(self._numbers) + 1)
            return f"ok #{n}" + (" (replayed)" if answer.replayed else "")
        if answer.status == 409 and answer.body.get("code") == "idempotency_key_in_use":
            return "in use (409)"
        return describe_problem(answer)

    def says(self, answers):
        return " | ".join(self.say(a) for a in answers)

    def mismatches(self):
        if self.skipped:
            return [f"scenario {self.number} not run in full: {self.skipped}"]
        return [
            f"scenario {self.number} ({name.replace('_', ' ')}): {self.effects.get(name)} effects, expected {want}"
            for name, want in self.expected.items()
            if self.effects.get(name) != want
        ]


class Demo:
    def __init__(self, server):
        self.server = server
        self.prefix = "demo-" + uuid.uuid4().hex[:8]
        self.timings = []

    def run_tag(self, suffix):
        return f"{self.prefix}-{suffix}"

    @staticmethod
    def new_key():
        return "demo-" + str(uuid.uuid4())

    def charge(self, *args, **kwargs):
        started = time.monotonic()
        answer = self.server.charge(*args, **kwargs)
        self.timings.append(time.monotonic() - started)
        return answer

    def retry_without_a_key(self):
        b = Block(1, "A retry without a key applies the effect again")
        run = self.run_tag(1)
        b.runs.append(run)
        answers = [self.charge(run) for _ in range(4)]
        b.row("requests sent", len(answers))
        b.row("times the effect was applied", b.count("applied", self.server.effects(run), 4))
        b.row("what the client got", b.says(answers))
        return b

    def retries_with_a_key(self):
        b = Block(2, "The same retries with an idempotency key")
        run, key = self.run_tag(2), self.new_key()
        b.runs.append(run)
        answers = [self.charge(run, key) for _ in range(4)]
        b.row("requests sent", len(answers))
        b.row("times the effect was applied", b.count("applied", self.server.effects(run), 1))
        b.row("what the client got", b.says(answers))
        return b

    def the_window(self, fault_injection):
        b = Block(3, "The window: the effect happened, the answer did not arrive")
        if not fault_injection:
            b.skipped = "the server runs without FAULT_INJECTION=true"
            return b
        run, key = self.run_tag(3), self.new_key()
        b.runs.append(run)
        first = self.charge(run, key, fault="drop-response")
        b.row("first try: what the client saw", b.say(first))
        b.row("effects by then", b.count("by_then", self.server.effects(run), 1))
        retry = self.charge(run, key)
        b.row("the retry: what the client saw", b.say(retry))
        b.row("effects in total", b.count("in_total", self.server.effects(run), 1))
        return b

    def two_at_once(self, naive_endpoint):
        b = Block(4, "Two retries at the same moment, one key")
        run, key = self.run_tag("4-claimed-first"), self.new_key()
        b.runs.append(run)
        answers = at_once(lambda: self.charge(run, key), lambda: self.charge(run, key))
        # Which of two simultaneous requests wins is chance: list the winner first.
        answers.sort(key=lambda a: (a.status != 201, a.replayed))
        b.part("key claimed before the work (POST /v1/charges)")
        b.row("requests sent", len(answers))
        b.row("what the client got", b.says(answers))
        b.row("times the effect was applied", b.count("key_claimed_before_the_work", self.server.effects(run), 1))

        b.part("key written after the work (POST /demo/naive/charges)")
        if not naive_endpoint:
            b.row("not run", "the server runs without DEMO_UNSAFE_ENDPOINTS=true")
            b.expected["key_written_after_the_work"] = 2
            b.skipped = "the naive half needs DEMO_UNSAFE_ENDPOINTS=true on the server"
            return b
        run, key = self.run_tag("4-written-after"), self.new_key()
        b.runs.append(run)
        naive = "/demo/naive/charges"
        answers = at_once(lambda: self.charge(run, key, path=naive), lambda: self.charge(run, key, path=naive))
        answers.sort(key=lambda a: (a.status != 201, a.replayed))
        b.row("requests sent", len(answers))
        b.row("what the client got", b.says(answers))
        b.row("times the effect was applied", b.count("key_written_after_the_work", self.server.effects(run), 2))
        return b

    def a_new_key_per_attempt(self):
        b = Block(5, "A new key per attempt protects nothing")
        run, key = self.run_tag("5-one-key"), self.new_key()
        b.runs.append(run)
        b.part("three attempts, one key")
        answers = [self.charge(run, key) for _ in range(3)]
        b.row("what the client got", b.says(answers))
        one = b.count("one_key", self.server.effects(run), 1)
        b.row("times the effect was applied", one)

        run = self.run_tag("5-new-key-each")
        b.runs.append(run)
        b.part("three attempts, a new key each")
        answers = [self.charge(run, self.new_key()) for _ in range(3)]
        b.row("what the client got", b.says(answers))
        each = b.count("new_key_each", self.server.effects(run), 3)
        b.row("times the effect was applied", each)

        b.part(None)
        b.row("effects in total", b.count("total", one + each, 4))
        return b

    def a_webhook_delivered_three_times(self, receivers):
        b = Block(6, "A webhook delivered three times")
        if not receivers:
            b.skipped = "the webhook receivers need DEMO_UNSAFE_ENDPOINTS=true on the server"
            return b
        run = self.run_tag(6)
        b.runs.append(run)
        modes = {
            "naive": "receiver without an inbox (POST /demo/receiver/naive)",
            "inbox": "receiver with an inbox (POST /demo/receiver/inbox)",
        }
        # Two endpoints, one per receiver, each receiver holding its endpoint's
        # secret and answering 500 to the first two deliveries of each event,
        # after its work committed.
        endpoints = []
        try:
            for mode in modes:
                url = f"{self.server.url}/demo/receiver/{mode}?run={urllib.parse.quote(run)}"
                endpoint = self.server.create_endpoint(url, ["charge.succeeded"])
                if endpoint.status != 201:
                    b.skipped = f"POST /v1/webhook_endpoints answered {describe_problem(endpoint)}"
                    return b
                endpoints.append(endpoint.body["id"])
                receiver = self.server.set_up_receiver(run, mode, endpoint.body["secret"], fail_first=2)
                if receiver.status != 200:
                    b.skipped = f"POST /demo/receivers answered {describe_problem(receiver)}"
                    return b
            charge = self.charge(run, self.new_key())
            b.row("the charge (POST /v1/charges)", b.say(charge))
            event = charge.charge_id and self.server.event_of(charge.charge_id, "charge.succeeded")
            if not event:
                b.skipped = "the charge or its charge.succeeded event is missing"
                return b
            b.row("its event", "charge.succeeded, sent to two receivers")
            b.row("each receiver", "does its work, then answers 500 to the first two")
            deliveries = self.delivered(event)
            if any(d.get("status") == "pending" for d in deliveries):
                b.skipped = (
                    f"the deliveries had not ended after {DELIVERY_WAIT} s; start the server with "
                    "WEBHOOK_RETRY_BASE=200ms WEBHOOK_POLL_INTERVAL=100ms"
                )
        finally:
            for endpoint in endpoints:
                self.server.request("DELETE", f"/v1/webhook_endpoints/{endpoint}")

        counts = self.server.receivers(run)
        for mode, heading in modes.items():
            b.part(heading)
            sent = [d for d in deliveries if f"/demo/receiver/{mode}?" in d.get("url", "")]
            got = [attempt_answer(a) for d in sent for a in d.get("attempts", [])]
            b.row("deliveries received", b.count(f"{mode}_deliveries", counts[mode]["deliveries"], 3))
            b.row("what the sender got", " | ".join(got) or "nothing")
            b.row("orders shipped", b.count(f"{mode}_shipments", counts[mode]["shipments"], {"naive": 3, "inbox": 1}[mode]))
        return b

    def delivered(self, event):
        """The event's deliveries, once none is pending (or DELIVERY_WAIT is over)."""
        deadline = time.monotonic() + DELIVERY_WAIT
        while True:
            deliveries = self.server.deliveries(event)
            ended = deliveries and all(d.get("status") != "pending" for d in deliveries)
            if ended or time.monotonic() > deadline:
                return deliveries
            time.sleep(0.1)


# ----------------------------------------------------------------------------
# Checking the server, printing


def check_server(server, log):
    """Returns (fault_injection, naive_endpoint, receivers); raises Unusable when the
    server is down, the key is wrong or /demo/effects is missing. The probes
    create nothing: each is refused before any write."""
    health = server.request("GET", "/healthz", auth=False)
    if health.status != 200:
        raise Unusable(f"GET {server.url}/healthz answered {describe_problem(health)}")
    effects = server.request("GET", "/demo/effects?run=probe-" + uuid.uuid4().hex[:8])
    if effects.status in (401, 403):
        raise Unusable(
            f"the server refused the API key ({describe_problem(effects)}); "
            "set ONCEPAY_API_KEY to the demo merchant's secret key"
        )
    if effects.status != 200:
        raise Unusable(f"GET /demo/effects answered {describe_problem(effects)}: this server predates the workshop routes")

    # An unknown fault: 400 invalid_fault when faults are honoured, else 400
    # fault_injection_disabled. Both refuse before anything is written.
    probe = server.request("POST", "/v1/charges", {}, {"Oncepay-Fault": "demo-probe"})
    fault_injection = probe.body.get("code") == "invalid_fault"
    if not fault_injection:
        log(
            f"the server at {server.url} runs without FAULT_INJECTION=true "
            f"(the probe got {describe_problem(probe)}): scenario 3 cannot run"
        )
    # The naive endpoint refuses a request without a key (400); it is 404 when disabled.
    probe = server.request("POST", "/demo/naive/charges", {})
    naive_endpoint = probe.status == 400
    if not naive_endpoint:
        log(
            f"the server at {server.url} has no POST /demo/naive/charges (the probe got "
            f"{describe_problem(probe)}); start it with DEMO_UNSAFE_ENDPOINTS=true: half of scenario 4 cannot run"
        )
    # The webhook receivers' counts: 200 when served, 404 when not.
    probe = server.request("GET", "/demo/receivers?run=probe-" + uuid.uuid4().hex[:8])
    receivers = probe.status == 200
    if not receivers:
        log(
            f"the server at {server.url} has no webhook receivers (GET /demo/receivers got "
            f"{describe_problem(probe)}); start it with DEMO_UNSAFE_ENDPOINTS=true: scenario 6 cannot run"
        )
    return fault_injection, naive_endpoint, receivers


def wait_until_healthy(server, pid, seconds, log):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pid:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise Unusable(f"the server (pid {pid}) exited before answering /healthz")
        try:
            with urllib.request.urlopen(server.url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.2)
    raise Unusable(f"{server.url}/healthz did not answer within {seconds} s")


class Style:
    def __init__(self, enabled):
        self.enabled = enabled

    def _wrap(self, code, text):
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def bold(self, text):
        return self._wrap("1", text)

    def red(self, text):
        return self._wrap("1;31", text)


def render_text(blocks, mismatches, style, width):
    names = [len(name) + (2 if part else 0) for b in blocks for part, name, _ in b.rows]
    column = max(names, default=20) + 3
    out = []
    for b in blocks:
        out.append(style.bold(f"{b.number}. {b.title.upper()}"))
        if b.skipped and not b.rows:
            out.append(f"   (not run: {b.skipped})")
        current = None
        for part, name, value in b.rows:
            if part != current:
                current = part
                if part:
                    out.append(f"   {part}")
            indent = "     " if part else "   "
            label = f"{indent}{name}".ljust(column + 3)
            out.extend(wrap_value(label, str(value), width))
        out.append("")
    if mismatches:
        out.append(style.red("NOT AS EXPECTED:"))
        out.extend(f"   {m}" for m in mismatches)
    else:
        out.append("Every count above was read from the database after its scenario, and is as expected.")
    return "\n".join(out)


def wrap_value(label, value, width):
    """One row; a long ` | ` list continues under itself when the terminal is
    too narrow (width None: never wrap)."""
    if width is None or len(label) + len(value) <= width:
        return [label + value]
    lines, line = [], ""
    for piece in value.split(" | "):
        candidate = piece if not line else line + " | " + piece
        if line and len(label) + len(candidate) > width:
            lines.append(line + " |")
            line = piece
        else:
            line = candidate
    lines.append(line)
    pad = " " * len(label)
    return [label + lines[0]] + [pad + l for l in lines[1:]]


def render_json(server, blocks, mismatches):
    return json.dumps(
        {
            "server": server.url,
            "ok": not mismatches,
            "mismatches": mismatches,
            "scenarios": [
                {
                    "scenario": b.number,
                    "title": b.title.upper(),
                    "runs": b.runs,
                    "rows": [
                        {"part": part, "name": name, "value": value} if part else {"name": name, "value": value}
                        for part, name, value in b.rows
                    ],
                    "effects": b.effects,
                    "expected": b.expected,
                    "ok": not b.mismatches(),
                    **({"skipped": b.skipped} if b.skipped else {}),
                }
                for b in blocks
            ],
        },
        indent=2,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8080")
    parser.add_argument(
        "--key",
        default=os.environ.get("ONCEPAY_API_KEY"),
        help="the merchant's secret key, sk_test_... (default: $ONCEPAY_API_KEY)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON document")
    parser.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="wait this long for /healthz first")
    parser.add_argument("--server-pid", type=int, default=0, help="stop waiting if this process exits")
    args = parser.parse_args()
    if not args.key:
        parser.error("no API key: pass --key or set ONCEPAY_API_KEY")

    me = "demo"

    def log(message):
        print(f"{me}: {message}", file=sys.stderr, flush=True)

    server = Server(args.url, args.key)
    try:
        if args.wait:
            wait_until_healthy(server, args.server_pid, args.wait, log)
        fault_injection, naive_endpoint, receivers = check_server(server, log)
        demo = Demo(server)
        log(f"running the six scenarios against {server.url} (run tags {demo.prefix}-*)")
        blocks = [
            demo.retry_without_a_key(),
            demo.retries_with_a_key(),
            demo.the_window(fault_injection),
            demo.two_at_once(naive_endpoint),
            demo.a_new_key_per_attempt(),
            demo.a_webhook_delivered_three_times(receivers),
        ]
    except Unusable as e:
        log(f"error: {e}")
        return 2

    mismatches = [m for b in blocks for m in b.mismatches()]
    naive = next(b for b in blocks if b.number == 4).effects.get("key_written_after_the_work")
    slowest = max(demo.timings, default=0)
    if naive == 1 and slowest < 0.2:
        mismatches.append(
            "the naive race did not happen: requests take under 200 ms here; "
            "start the server with PROCESSOR_LATENCY_MS=400"
        )
    if args.json:
        print(render_json(server, blocks, mismatches))
    else:
        tty = sys.stdout.isatty()
        style = Style(tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb")
        width = shutil.get_terminal_size().columns if tty else None
        print(render_text(blocks, mismatches, style, width))
    for m in mismatches:
        log(f"not as expected: {m}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
