#!/usr/bin/env python3
"""The workshop demo: thirteen scenarios, eleven against a running oncepay server.

Run by scripts/demo (which starts two servers first, or uses ONCEPAY_URL); it
can also be run on its own:

    ONCEPAY_API_KEY=sk_test_... python3 scripts/lib/demo.py --url http://127.0.0.1:8080 \
        [--pitfalls-url http://127.0.0.1:8081] [--json] \
        [--failover-bin target/debug/oncepay --pg-bin /usr/lib/postgresql/15/bin \
         --failover-dir target/demo/failover --failover-database-url postgres://...]

Scenarios 8 and 9 run against the second server (--pitfalls-url): a short key
TTL, Redis, and something that restarts it when scenario 8 crashes it.
Scenario 11 makes its own Postgres servers and oncepay processes
(scripts/lib/failover.py), from the --failover-* options. Scenario 13 runs
the model checker's binary (--model-bin, crates/oncepay-model) and no request.

Every effect count printed is read from the server's GET /demo/effects (the
processor's payments and refunds in the database) after the scenario, never
counted here; scenario 6's shipments and deliveries from GET /demo/receivers
(the workshop's webhook receivers' tables); scenario 10's payments from GET
/demo/processor/payments (the card gateway's own ledger, over its API);
scenario 11's from oncepay's and the gateway's databases and from `oncepay
reconcile`. Each scenario tags its charges with a fresh run tag
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
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import failover

TIMEOUT = 30  # seconds, per request
DELIVERY_WAIT = 60  # seconds, for scenario 6's webhook deliveries to end
REFUND_CHARGE = 1000  # scenario 7: the charge, and each of its two refunds
REFUND_EACH = 600
LONGEST_TTL = 10  # seconds: scenarios 8 and 9 wait for a key to expire


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

    def charge(self, run, key=None, fault=None, path="/v1/charges", amount=500):
        headers = {}
        if key is not None:
            headers["Idempotency-Key"] = key
        if fault is not None:
            headers["Oncepay-Fault"] = fault
        body = {"amount": amount, "currency": "usd", "source": "tok_visa", "metadata": {"demo_run": run}}
        return self.request("POST", path, body, headers)

    def refund(self, charge_id, amount, key, path="/v1/refunds"):
        return self.request("POST", path, {"charge": charge_id, "amount": amount}, {"Idempotency-Key": key})

    def key_state(self, key):
        """GET /v1/idempotency_keys/{key}: the answer (404 once unknown or expired)."""
        return self.request("GET", "/v1/idempotency_keys/" + urllib.parse.quote(key, safe=""))

    def settings(self):
        """GET /demo/settings: the TTL, timeouts and switches; None when not served."""
        answer = self.request("GET", "/demo/settings")
        return answer.body if answer.status == 200 else None

    def healthy(self):
        try:
            with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):
            return False

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

    def event_of(self, charge_id, kind, within=5.0):
        """The event of type KIND about the charge, from the newest events.

        The list shows an event once every transaction that began writing
        before it has ended, usually at once: it is asked again for up to
        WITHIN seconds."""
        deadline = time.monotonic() + within
        while True:
            answer = self.request("GET", "/v1/events?limit=100&type=" + urllib.parse.quote(kind))
            if answer.status != 200:
                raise Unusable(f"GET /v1/events answered {describe_problem(answer)}")
            for event in answer.body.get("data", []):
                if event.get("data", {}).get("object", {}).get("id") == charge_id:
                    return event["id"]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def deliveries(self, event_id):
        answer = self.request("GET", f"/v1/events/{urllib.parse.quote(event_id)}/deliveries")
        if answer.status != 200:
            raise Unusable(f"GET /v1/events/{event_id}/deliveries answered {describe_problem(answer)}")
        return answer.body.get("data", [])

    def effects(self, run):
        """Payments the processor recorded for the charges tagged RUN."""
        return int(self.money(run)["payments"])

    def money(self, run):
        """GET /demo/effects for RUN: payments, charged, refunds, refunded."""
        answer = self.request("GET", "/demo/effects?run=" + urllib.parse.quote(run))
        if answer.status != 200 or "payments" not in answer.body:
            raise Unusable(f"GET /demo/effects answered {describe_problem(answer)}")
        return answer.body


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


# The blocks in the order they run: number, title, and the rule each
# one teaches, printed as its last line.
BLOCKS = [
    (1, "A retry without a key applies the effect again",
     "without a key, a retry is a new order to the server: it applies the effect again"),
    (2, "The same retries with an idempotency key",
     "one key per logical operation: every retry gets the first answer, and the effect happens once"),
    (3, "The window: the effect happened, the answer did not arrive",
     "a lost answer is not a failed charge: the retry with the same key gets the saved answer"),
    (4, "Two retries at the same moment, one key",
     "claim the key before the work, in one atomic statement; a look-up first lets both through"),
    (5, "A new key per attempt protects nothing",
     "the key belongs to the operation, never to an attempt"),
    (6, "A webhook delivered three times",
     "deliveries come at least once: the receiver keeps an inbox of event ids, written with its effect"),
    (7, "Idempotency is not concurrency control",
     "a key stops a retry, not a race: a balance takes one conditional update"),
    (8, "The key kept outside the business transaction",
     "the key and the business write commit together"),
    (9, "A TTL shorter than the client's retry horizon",
     "TTL >= the longest retry horizon of any client"),
    (10, "The same key to the provider",
     "the key the provider gets is derived from the operation, never from the attempt"),
    (11, "An acknowledged charge lost in a failover",
     "acknowledge only what the standby you fail over to already has"),
    (12, "The message handler forgot its inbox",
     "deduplicate at every at-least-once boundary: the consumer keeps an inbox of event ids, written with its effect"),
    (13, "Every interleaving, not just the ones we thought of",
     "check the protocol over every interleaving: each naive design has a short way to break exactly once"),
]
TITLES = {number: title for number, title, _ in BLOCKS}
RULES = {number: rule for number, _, rule in BLOCKS}


def chosen_blocks(spec):
    """The block numbers SPEC names: `4`, `1,3`, `2-5`, or a mix; all when
    SPEC is None. A ValueError names what is wrong."""
    if spec is None:
        return [number for number, _, _ in BLOCKS]
    chosen = set()
    for piece in spec.split(","):
        first, _, last = piece.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"'{piece}' is not a block number or a range such as 2-5")
        numbers = range(int(first), int(last or first) + 1)
        unknown = [n for n in numbers if n not in TITLES] or ([] if numbers else [piece])
        if unknown:
            raise ValueError(f"no block {unknown[0]} (the blocks are 1 to {len(BLOCKS)})")
        chosen.update(numbers)
    return [number for number, _, _ in BLOCKS if number in chosen]


class Block:
    """One titled block: rows of (part, name, value), the effect counts read
    from the database, and the counts expected."""

    def __init__(self, number, title=None):
        self.number = number
        self.title = title or TITLES[number]
        self.rule = RULES.get(number)
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

    @staticmethod
    def say_refund(answer):
        """What a refund got: `refunded 600`, `amount too large (400)`, ..."""
        if answer.status == 201:
            return f"refunded {answer.body.get('amount')}" + (" (replayed)" if answer.replayed else "")
        if answer.status == 400 and answer.body.get("code") == "amount_too_large":
            return "amount too large (400)"
        return describe_problem(answer)

    def mismatches(self):
        if self.skipped:
            return [f"scenario {self.number} not run in full: {self.skipped}"]
        return [
            f"scenario {self.number} ({name.replace('_', ' ')}): {self.effects.get(name)} effects, expected {want}"
            for name, want in self.expected.items()
            if self.effects.get(name) != want
        ]


class Demo:
    def __init__(self, server, pitfalls=None):
        self.server = server
        # The server of blocks 8 and 9 (short TTL, Redis, restarted after a
        # crash), or None.
        self.pitfalls = pitfalls
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
        b = Block(1)
        run = self.run_tag(1)
        b.runs.append(run)
        answers = [self.charge(run) for _ in range(4)]
        b.row("requests sent", len(answers))
        b.row("times the effect was applied", b.count("applied", self.server.effects(run), 4))
        b.row("what the client got", b.says(answers))
        return b

    def retries_with_a_key(self):
        b = Block(2)
        run, key = self.run_tag(2), self.new_key()
        b.runs.append(run)
        answers = [self.charge(run, key) for _ in range(4)]
        b.row("requests sent", len(answers))
        b.row("times the effect was applied", b.count("applied", self.server.effects(run), 1))
        b.row("what the client got", b.says(answers))
        return b

    def the_window(self, fault_injection):
        b = Block(3)
        if not fault_injection:
            b.skipped = "the server runs without FAULT_INJECTION=true"
            return b
        run, key = self.run_tag(3), self.new_key()
        b.runs.append(run)
        first = self.charge(run, key, fault="drop-response")
        b.row("first try: what the client saw", b.say(first))
        b.row("times the effect was applied by then", b.count("by_then", self.server.effects(run), 1))
        retry = self.charge(run, key)
        b.row("the retry: what the client saw", b.say(retry))
        b.row("times the effect was applied in all", b.count("in_total", self.server.effects(run), 1))
        return b

    def two_at_once(self, naive_endpoint):
        b = Block(4)
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
        b = Block(5)
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
        b = Block(6)
        if not receivers:
            b.skipped = "the webhook receivers need DEMO_UNSAFE_ENDPOINTS=true and WEBHOOK_ALLOW_PRIVATE=true on the server"
            return b
        run = self.run_tag(6)
        b.runs.append(run)
        modes = {
            "inbox": "receiver with an inbox (POST /demo/receiver/inbox)",
            "naive": "receiver without an inbox (POST /demo/receiver/naive)",
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

    def refunds_at_once(self, naive_endpoint):
        b = Block(7)
        b.row("each charge", f"{REFUND_CHARGE}, then two refunds of {REFUND_EACH} at the same moment, a key each")
        parts = [
            ("one_update", "one conditional update (POST /v1/refunds)", "/v1/refunds", 1),
            ("read_then_write", "read, check, then write (POST /demo/naive/refunds)", "/demo/naive/refunds", 2),
        ]
        for name, heading, path, refunds in parts:
            b.part(heading)
            if path != "/v1/refunds" and not naive_endpoint:
                b.row("not run", "the server runs without DEMO_UNSAFE_ENDPOINTS=true")
                b.expected[f"{name}_refunds"] = refunds
                b.skipped = "the naive half needs DEMO_UNSAFE_ENDPOINTS=true on the server"
                return b
            run = self.run_tag(f"7-{name.replace('_', '-')}")
            b.runs.append(run)
            charge = self.charge(run, self.new_key(), amount=REFUND_CHARGE)
            if not charge.charge_id:
                b.skipped = f"the charge answered {describe_problem(charge)}"
                return b
            keys = [self.new_key(), self.new_key()]
            answers = at_once(*[
                (lambda k=k: self.server.refund(charge.charge_id, REFUND_EACH, k, path)) for k in keys
            ])
            answers.sort(key=lambda a: a.status != 201)
            b.row("requests sent", len(answers))
            b.row("what the client got", " | ".join(b.say_refund(a) for a in answers))
            money = self.server.money(run)
            b.count(f"{name}_refunds", int(money["refunds"]), refunds)
            refunded = b.count(f"{name}_refunded", int(money["refunded"]), REFUND_EACH * refunds)
            b.row("money refunded at the processor", f"{refunded} of {money['charged']} charged")
            books = self.server.request("GET", "/v1/charges/" + urllib.parse.quote(charge.charge_id))
            recorded = books.body.get("amount_refunded")
            note = "" if recorded == refunded else ": each wrote what it read plus its own"
            b.row("the charge's amount_refunded", f"{recorded}{note}")
        return b

    def the_same_key_to_the_provider(self, fault_injection, naive_endpoint):
        b = Block(10)
        if not (fault_injection and naive_endpoint):
            b.skipped = "this scenario needs FAULT_INJECTION=true and DEMO_UNSAFE_ENDPOINTS=true on the server"
            return b
        b.row("each payment", "oncepay asks the card gateway for 500; the gateway takes it, then its answer is lost")
        parts = [
            ("same_key", "the same processor key on every attempt", "same", 1),
            ("new_key_per_attempt", "a new processor key per attempt", "new_per_attempt", 2),
        ]
        for name, heading, keys, expected in parts:
            b.part(heading)
            run = self.run_tag(f"10-{name.replace('_', '-')}")
            b.runs.append(run)
            answer = self.server.request("POST", "/demo/processor/payments", {"run": run, "keys": keys})
            if answer.status != 200:
                b.skipped = f"POST /demo/processor/payments answered {describe_problem(answer)}"
                return b
            attempts = answer.body.get("attempts", [])
            b.row("attempts sent", len(attempts))
            b.row("processor keys", " | ".join(a.get("processor_key", "?") for a in attempts))
            b.row("what oncepay got", " | ".join(a.get("answer", "?") for a in attempts))
            counted = self.server.request("GET", "/demo/processor/payments?run=" + urllib.parse.quote(run))
            if counted.status != 200 or "payments" not in counted.body:
                raise Unusable(f"GET /demo/processor/payments answered {describe_problem(counted)}")
            payments = b.count(name, int(counted.body["payments"]), expected)
            b.row("payments in the processor's ledger", f"{payments} ({counted.body.get('charged')} charged)")
        return b

    def an_acknowledged_charge_lost_in_a_failover(self, lab):
        b = Block(11)
        if lab is None:
            b.skipped = (
                "it starts and kills Postgres servers of its own: it runs from scripts/demo "
                "(which builds oncepay) without ONCEPAY_URL, or with the --failover-* options"
            )
            return b
        try:
            lab.run(b, self.prefix)
        except (failover.Failed, Unusable) as e:
            b.skipped = str(e)
        return b

    def the_message_handler_forgot_its_inbox(self):
        b = Block(12)
        b.row("each part", "one charge.succeeded published once to NATS JetStream; the handler books it, "
              "then dies before its ack, and the broker delivers it again")
        parts = [
            ("inbox", "a handler with an inbox (INSERT ... ON CONFLICT DO NOTHING, then the effect)", 1),
            ("naive", "a handler without one (the effect on every delivery)", 2),
        ]
        for handler, heading, expected in parts:
            b.part(heading)
            run = self.run_tag(f"12-{handler}")
            b.runs.append(run)
            answer = self.server.request("POST", "/demo/broker/deliveries", {"run": run, "handler": handler})
            if answer.status != 200:
                b.skipped = f"POST /demo/broker/deliveries answered {describe_problem(answer)}"
                return b
            handled = answer.body.get("handled", [])
            b.row("deliveries", len(handled))
            b.row("what the handler did", " | ".join(handled))
            b.row("times the effect was applied", b.count(handler, int(answer.body["effects"]), expected))
        b.part("the stream's duplicate window: a TTL for message ids")
        run = self.run_tag("12-window")
        b.runs.append(run)
        answer = self.server.request("POST", "/demo/broker/window", {"run": run})
        if answer.status != 200:
            b.skipped = f"POST /demo/broker/window answered {describe_problem(answer)}"
            return b
        window = answer.body
        b.row("the window", f"{window['window_ms'] / 1000:g} s here (NATS_DUPLICATE_WINDOW, 2 min by default)")
        b.row("one Nats-Msg-Id published twice inside it",
              f"{b.count('window_inside', int(window['inside']), 1)} message in the stream")
        b.row("and once more after it", f"{b.count('window_after', int(window['after']), 2)} messages in the stream")
        return b

    # Block 13's designs, the protocol first: the model's name and how the
    # block calls it. crates/oncepay-model has all eight naive designs.
    MODELLED = [
        ("real", "oncepay's protocol"),
        ("check-then-act", "naive: the key read, then written (block 4)"),
        ("two-transactions", "naive: the key claimed alone, the charge written after the gateway (block 8)"),
        ("no-void-fence", "naive: a sweeper that settles a stale charge without asking the gateway"),
    ]

    def every_interleaving(self, model_bin):
        b = Block(13)
        b.row("each part", "the protocol as a model (crates/oncepay-model): two clients, two instances that may "
              "crash, the gateway, the sweeper, a clock and a lossy network; Stateright explores every "
              "interleaving, breadth first, so a counterexample is a shortest one")
        if not model_bin:
            b.skipped = "needs the model's binary (scripts/demo builds it: cargo build -p oncepay-model)"
            return b
        names = [name for name, _ in self.MODELLED]
        done = subprocess.run([model_bin, "explain", "--json", *names], capture_output=True, text=True)
        if not done.stdout.strip():
            b.skipped = f"oncepay-model explain failed: {done.stderr.strip()[-300:]}"
            return b
        reports = {r["variant"]: r for r in json.loads(done.stdout)}
        for name, heading in self.MODELLED:
            report = reports[name]
            b.part(heading)
            b.row("states explored", f"{report['states']:,} in {report['seconds']:.1f} s")
            broken = report["broken"]
            if broken:
                for n, step in enumerate(broken["steps"], 1):
                    b.row(f"{n:2} {step['lane']}", step["what"])
                b.row("broken", f"{broken['property']} {broken['consequence']}".strip())
            b.row("counterexamples found", b.count(name, 1 if broken else 0, 0 if name == "real" else 1))
        return b

    def at(self, started):
        return f"{time.monotonic() - started:4.1f} s"

    def until_back(self, server, seconds=30):
        """Waits for SERVER to answer /healthz again, after its crash."""
        deadline = time.monotonic() + seconds
        while not server.healthy():
            if time.monotonic() > deadline:
                raise Unusable(
                    f"{server.url} did not come back within {seconds} s of its crash; "
                    "run it under something that restarts it (scripts/demo does)"
                )
            time.sleep(0.05)

    def key_outside_the_transaction(self, settings):
        b = Block(8)
        server = self.pitfalls
        missing = pitfalls_missing(settings, redis=True)
        if missing:
            b.skipped = missing
            return b
        ttl = settings["idempotency_key_ttl_ms"] / 1000
        b.row("the key's TTL", f"{ttl:g} s (IDEMPOTENCY_KEY_TTL), in Redis and in Postgres alike")

        b.part("key and charge in one transaction (POST /v1/charges)")
        run, key = self.run_tag("8-one-transaction"), self.new_key()
        b.runs.append(run)
        started = time.monotonic()
        first = server.charge(run, key, fault="crash-after-processor")
        b.row(f"{self.at(started)}  the charge, crash after the processor", crashed(b, first))
        self.until_back(server)
        b.row(f"{self.at(started)}  the server", "restarted")
        deadline = time.monotonic() + settings["processing_timeout_ms"] / 1000 + 10
        seen = None
        while time.monotonic() < deadline:
            state = server.key_state(key).body.get("status")
            if state != seen:
                seen = state
                words = {"processing": "processing: no answer saved", "completed": "completed by the sweeper"}
                b.row(f"{self.at(started)}  the key", words.get(state, state or "unknown"))
            if state == "completed":
                break
            time.sleep(0.05)
        retry = server.charge(run, key)
        b.row(f"{self.at(started)}  retry", b.say(retry))
        b.row("times the effect was applied", b.count("key_in_the_transaction", server.effects(run), 1))

        b.part("key in Redis, charge in Postgres (POST /demo/redis/charges)")
        # The crashed try charged (#1) and its answer never came: a new charge is #2.
        b._numbers = {"the crashed try's charge": 1}
        run, key, path = self.run_tag("8-redis"), self.new_key(), "/demo/redis/charges"
        b.runs.append(run)
        started = time.monotonic()
        first = server.charge(run, key, fault="crash-after-commit", path=path)
        b.row(f"{self.at(started)}  the charge, crash after the commit", crashed(b, first))
        self.until_back(server)
        b.row(f"{self.at(started)}  the server", "restarted")
        deadline = started + ttl + 10
        while True:
            when = self.at(started)
            retry = server.charge(run, key, path=path)
            if retry.status != 409 or time.monotonic() > deadline:
                break
            left = (retry.body.get("redis_ttl_ms") or 0) / 1000
            b.row(f"{when}  retry", f"in use (409): Redis says processing, {left:.1f} s left")
            time.sleep(min(0.5, left + 0.05))
        b.row(f"{when}  retry, after the TTL", b.say(retry))
        b.row("times the effect was applied", b.count("key_in_redis", server.effects(run), 2))

        return b

    def a_ttl_shorter_than_the_retry_horizon(self, settings):
        b = Block(9)
        server = self.pitfalls
        missing = pitfalls_missing(settings, redis=False)
        if missing:
            b.skipped = missing
            return b
        ttl = settings["idempotency_key_ttl_ms"] / 1000
        b.row("where the TTL is set", f"IDEMPOTENCY_KEY_TTL: {ttl:g} s on this server (24 h by default)")
        for name, heading, wait, expected in [
            ("within", f"a retry within the TTL (after {ttl / 2:g} s)", ttl / 2, 1),
            ("after", f"a retry after the TTL (after {ttl + 1:g} s)", ttl + 1, 2),
        ]:
            b.part(heading)
            run, key = self.run_tag(f"9-{name}"), self.new_key()
            b.runs.append(run)
            first = server.charge(run, key)
            reported = server.key_state(key).body
            if name == "within" and reported.get("expires_at"):
                lifetime = reported["expires_at"] - reported["created_at"]
                b.row("where it is reported", f"GET /v1/idempotency_keys/{{key}}: expires_at = created_at + {lifetime} s")
            time.sleep(wait)
            gone = server.key_state(key)
            retry = server.charge(run, key)
            b.row("what the client got", b.says([first, retry]))
            if gone.status == 404:
                b.row("the key, just before the retry", "unknown or expired (404)")
            b.row("times the effect was applied", b.count(name, server.effects(run), expected))
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


def crashed(block, answer):
    """What the client saw of a request that crashed the server."""
    if answer.status is None:
        return "empty answer: the server died"
    return block.say(answer) + " (the server did not crash: is FAULT_INJECTION=true?)"


def pitfalls_missing(settings, redis):
    """Why the server of scenarios 8 and 9 cannot run them; None when it can."""
    if settings is None:
        return (
            "it needs a second server with IDEMPOTENCY_KEY_TTL=2s PROCESSING_TIMEOUT=1s SWEEP_INTERVAL=200ms "
            "FAULT_INJECTION=true DEMO_UNSAFE_ENDPOINTS=true and REDIS_URL, restarted when it crashes "
            "(scripts/demo starts one; with ONCEPAY_URL, give it as ONCEPAY_PITFALLS_URL)"
        )
    wanted = []
    if settings["idempotency_key_ttl_ms"] > LONGEST_TTL * 1000:
        wanted.append(f"IDEMPOTENCY_KEY_TTL of at most {LONGEST_TTL}s (2s, with PROCESSING_TIMEOUT=1s)")
    if redis:
        if not settings["fault_injection"]:
            wanted.append("FAULT_INJECTION=true")
        if not settings["demo_unsafe_endpoints"]:
            wanted.append("DEMO_UNSAFE_ENDPOINTS=true")
        if not settings["redis"]:
            wanted.append("REDIS_URL")
    if wanted:
        return "its server needs " + ", ".join(wanted)
    return None


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
    else:
        # The receivers are the server's own, on its address: the webhook
        # address guard refuses endpoints there unless WEBHOOK_ALLOW_PRIVATE=true.
        settings = server.settings()
        if settings is not None and settings.get("webhook_allow_private") is False:
            receivers = False
            log(
                f"the server at {server.url} refuses webhook endpoints on its own address; "
                "start it with WEBHOOK_ALLOW_PRIVATE=true: scenario 6 cannot run"
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


# What `#n` counts, said once, under the first block that shows one.
NUMBERS_LEGEND = "#n is the n-th distinct charge this block made: the same n, the same charge"


def render_block(b, style, width, legend):
    """One block as text, its rule last; with LEGEND, what `#n` counts."""
    names = [len(name) + (2 if part else 0) for part, name, _ in b.rows]
    column = max(names + [len("the rule")], default=20) + 3
    out = [style.bold(f"{b.number}. {b.title.upper()}")]
    if legend:
        out.extend(wrap_value("   ", f"({NUMBERS_LEGEND})", width))
    if b.skipped and not b.rows:
        out.extend(wrap_value("   ", f"(not run: {b.skipped})", width))
    current = None
    for part, name, value in b.rows:
        if part != current:
            current = part
            if part:
                out.extend(wrap_value("   ", part, width))
        indent = "     " if part else "   "
        label = f"{indent}{name}".ljust(column + 3)
        out.extend(wrap_value(label, str(value), width))
    if b.rule:
        out.extend(wrap_value("   " + "the rule".ljust(column), b.rule, width))
    out.append("")
    return "\n".join(out)


def shows_numbers(b):
    return any(re.search(r"#\d", str(value)) for _, _, value in b.rows)


def render_end(mismatches, style):
    if mismatches:
        return "\n".join([style.red("NOT AS EXPECTED:")] + [f"   {m}" for m in mismatches])
    return ("Every count above was read from the database after its scenario (block 13's from the\n"
            "model checker), and is as expected.")


def wrap_value(label, value, width):
    """One row, fitted to WIDTH columns (None: never wrapped): a long ` | `
    list continues under itself piece by piece, other text word by word."""
    if width is None or len(label) + len(value) <= width:
        return [label + value]
    room = max(width - len(label), 20)
    if " | " in value:
        lines, line = [], ""
        for piece in value.split(" | "):
            candidate = piece if not line else line + " | " + piece
            if line and len(candidate) > room:
                lines.append(line + " |")
                line = piece
            else:
                line = candidate
        lines.append(line)
    else:
        lines = textwrap.wrap(value, room, break_on_hyphens=False) or [value]
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
                    "rule": b.rule,
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


# What a block needs beyond the first server, so that scripts/demo starts
# only what the chosen blocks use.
NEEDS = {8: ("pitfalls", "redis"), 9: ("pitfalls",), 11: ("failover",), 12: ("nats",), 13: ("model",)}


def needs(chosen):
    """The parts the chosen blocks need beyond the first server, sorted."""
    return sorted({part for number in chosen for part in NEEDS.get(number, ())})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the server, e.g. http://127.0.0.1:8080 (needed unless --list)")
    parser.add_argument("--list", action="store_true", help="name the blocks, run nothing")
    parser.add_argument(
        "--needs",
        action="store_true",
        help="name what the blocks need beyond the server (pitfalls, redis, failover, nats, model), run nothing",
    )
    parser.add_argument(
        "--block", metavar="N", help="run only these blocks: a number, a list or a range (4; 1,3; 2-5)"
    )
    parser.add_argument("--step", action="store_true", help="wait for Enter before each block")
    parser.add_argument(
        "--key",
        default=os.environ.get("ONCEPAY_API_KEY"),
        help="the merchant's secret key, sk_test_... (default: $ONCEPAY_API_KEY)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON document")
    parser.add_argument("--wait", type=float, default=0, metavar="SECONDS", help="wait this long for /healthz first")
    parser.add_argument("--server-pid", type=int, default=0, help="stop waiting if this process exits")
    parser.add_argument(
        "--pitfalls-url",
        help="the server of scenarios 8 and 9: IDEMPOTENCY_KEY_TTL=2s, PROCESSING_TIMEOUT=1s, Redis, "
        "restarted when it crashes (scripts/demo starts one)",
    )
    parser.add_argument("--failover-bin", metavar="PATH", help="scenario 11: the oncepay binary to start")
    parser.add_argument("--model-bin", metavar="PATH", help="scenario 13: the oncepay-model binary")
    parser.add_argument("--pg-bin", metavar="DIR", help="scenario 11: the folder of initdb, pg_ctl, pg_basebackup")
    parser.add_argument(
        "--failover-dir", metavar="DIR", help="scenario 11: a git-ignored folder for its servers' data and logs"
    )
    parser.add_argument(
        "--failover-database-url",
        metavar="URL",
        help="scenario 11: a Postgres server (not one it fails over) for the card gateway's ledger",
    )
    args = parser.parse_args()
    try:
        chosen = chosen_blocks(args.block)
    except ValueError as e:
        parser.error(f"--block: {e}")
    if args.needs:
        print(" ".join(needs(chosen)))
        return 0
    if args.list:
        for number in chosen:
            print(f"{number:2}. {TITLES[number]}")
        return 0
    if not args.url:
        parser.error("--url is needed (the server to run the blocks against)")
    if args.step and args.json:
        parser.error("--step is for a presenter, --json for a program: not both")
    if not args.key:
        parser.error("no API key: pass --key or set ONCEPAY_API_KEY")
    given = [args.failover_bin, args.pg_bin, args.failover_dir, args.failover_database_url]
    if any(given) and not all(given):
        parser.error("scenario 11 needs all of --failover-bin, --pg-bin, --failover-dir and --failover-database-url")
    # A SIGTERM ends the run the way Ctrl-C does, so that scenario 11 stops
    # the servers it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    me = "demo"

    def log(message):
        print(f"{me}: {message}", file=sys.stderr, flush=True)

    server = Server(args.url, args.key)
    try:
        if args.wait:
            wait_until_healthy(server, args.server_pid, args.wait, log)
        fault_injection, naive_endpoint, receivers = check_server(server, log)
        pitfalls, settings = None, None
        if args.pitfalls_url:
            pitfalls = Server(args.pitfalls_url, args.key)
            if args.wait:
                wait_until_healthy(pitfalls, 0, args.wait, log)
            settings = pitfalls.settings()
            missing = pitfalls_missing(settings, redis=True)
            if missing:
                log(f"the server at {pitfalls.url}: {missing}")
        demo = Demo(server, pitfalls)
        where = server.url + (f" and {pitfalls.url}" if pitfalls else "")
        lab = None
        if args.failover_bin:
            lab = failover.Lab(
                args.failover_bin, args.pg_bin, args.failover_dir, args.failover_database_url, args.key, Server
            )
            where += " (scenario 11 on Postgres servers and oncepay processes of its own)"
        scenarios = {
            1: demo.retry_without_a_key,
            2: demo.retries_with_a_key,
            3: lambda: demo.the_window(fault_injection),
            4: lambda: demo.two_at_once(naive_endpoint),
            5: demo.a_new_key_per_attempt,
            6: lambda: demo.a_webhook_delivered_three_times(receivers),
            7: lambda: demo.refunds_at_once(naive_endpoint),
            8: lambda: demo.key_outside_the_transaction(settings),
            9: lambda: demo.a_ttl_shorter_than_the_retry_horizon(settings),
            10: lambda: demo.the_same_key_to_the_provider(fault_injection, naive_endpoint),
            11: lambda: demo.an_acknowledged_charge_lost_in_a_failover(lab),
            12: demo.the_message_handler_forgot_its_inbox,
            13: lambda: demo.every_interleaving(args.model_bin),
        }
        which = "the thirteen blocks" if len(chosen) == len(BLOCKS) else "block " + ", ".join(map(str, chosen))
        log(f"running {which} against {where} (run tags {demo.prefix}-*)")
        tty = sys.stdout.isatty()
        style = Style(tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb")
        # A terminal's width; 100 columns elsewhere (a log, a projector's pager).
        width = shutil.get_terminal_size().columns if tty else 100
        blocks, legend_due = [], True
        for number in chosen:
            if args.step:
                input(style.bold(f"[Enter] runs block {number}: {TITLES[number]} "))
            block = scenarios[number]()
            blocks.append(block)
            if not args.json:
                legend = legend_due and shows_numbers(block)
                legend_due = legend_due and not legend
                print(render_block(block, style, width, legend), flush=True)
    except Unusable as e:
        log(f"error: {e}")
        return 2

    mismatches = [m for b in blocks for m in b.mismatches()]
    naive = next((b.effects.get("key_written_after_the_work") for b in blocks if b.number == 4), None)
    slowest = max(demo.timings, default=0)
    if naive == 1 and slowest < 0.2:
        mismatches.append(
            "the naive race did not happen: requests take under 200 ms here; "
            "start the server with PROCESSOR_LATENCY_MS=400"
        )
    if args.json:
        print(render_json(server, blocks, mismatches))
    else:
        print(render_end(mismatches, style))
    for m in mismatches:
        log(f"not as expected: {m}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
