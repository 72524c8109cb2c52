"""Block 11 of the workshop: an acknowledged charge lost in a failover.

Imported by scripts/lib/demo.py, which gives it the oncepay binary, the
Postgres binaries, a folder and a Postgres server for the card gateway's
ledger (scripts/demo passes its own). Each part of the block (asynchronous,
then synchronous replication) makes two plain Postgres servers under
FOLDER/<part>/ (initdb, `pg_basebackup -R`, pg_ctl, loopback ports, run as
the `postgres` user when root), an `oncepay processor` whose ledger is on
the given server (database <name>_failover_<part>, made afresh), and one
`oncepay serve` whose multi-host DATABASE_URL names both servers, so that
it follows the primary to the promoted standby; it stops all of them
before it returns, and each part's logs stay in its folder.

The standby is made to lag by stopping its WAL receiver: on the standby,
`ALTER SYSTEM SET primary_conninfo = ''` and a reload. Pausing the replay
(`pg_wal_replay_pause()`) would not do: promotion replays every WAL record
already received, the paused ones too. Every count is read from a
database: the charges from oncepay's (the promoted standby), the payments
from the processor's ledger, the differences from `oncepay reconcile --json`.

Python 3 standard library only; `psql` reads the databases.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.parse

WAIT = 30  # seconds: the longest any step may take before the block gives up
IN_FLIGHT_AGE = 1.0  # seconds: reconcile's PROCESSING_TIMEOUT, past which a pair is compared
STANDBY_NAME = "standby"  # the standby's cluster_name, hence its application_name


class Failed(Exception):
    """A step of the block could not be done; the message says which."""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def url_with_database(url, name):
    """URL (postgres://...) naming the database NAME instead."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


def database_of(url):
    return urllib.parse.urlsplit(url).path.lstrip("/") or "postgres"


def redact(url):
    """URL without a password."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def psql(url, sql):
    """One statement's first value (psql -At), or Failed."""
    done = subprocess.run(
        ["psql", "-X", "-w", "-At", "-v", "ON_ERROR_STOP=1", url, "-c", sql],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env={**os.environ, "PGCONNECT_TIMEOUT": "5"},
    )
    if done.returncode != 0:
        raise Failed(f"psql {redact(url)} -c {sql!r}: {done.stderr.strip()}")
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def until(what, check, seconds=WAIT):
    """Polls CHECK until it returns something true; returns it, or Failed."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"{what}: not so after {seconds} s")
        time.sleep(0.05)


class Postgres:
    """One plain Postgres server of the pair: a data folder, a port."""

    def __init__(self, lab, folder, port):
        self.lab = lab
        self.data = os.path.join(folder, "data")
        self.log = os.path.join(folder, "postgres.log")
        self.port = port
        self.conninfo = ""

    def url(self, database="postgres"):
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def sql(self, statement, database="postgres"):
        return psql(self.url(database), statement)

    def configure(self, **settings):
        """Appends SETTINGS to postgresql.conf (the last line of a name wins)."""
        lines = [f"{name} = {value}" for name, value in settings.items()]
        with open(os.path.join(self.data, "postgresql.conf"), "a") as conf:
            conf.write("\n# scripts/lib/failover.py\n" + "\n".join(lines) + "\n")

    def start(self):
        self.lab.pg("pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", str(WAIT), "start")

    def running(self):
        return os.path.exists(os.path.join(self.data, "postmaster.pid"))

    def kill(self):
        """Stops it as a crash would: no shutdown checkpoint, nothing flushed to a standby."""
        self.lab.pg("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")


class Lab:
    """What one run of the block needs: binaries, a folder, the ledger's server."""

    def __init__(self, oncepay_bin, pg_bin, folder, database_url, api_key, server_class):
        self.oncepay = os.path.abspath(oncepay_bin)
        # The folder initdb really lives in (PATH may hold links to some tools
        # only), where Debian keeps pg_basebackup too.
        self.pg_bin = os.path.dirname(os.path.realpath(os.path.join(pg_bin, "initdb")))
        self.folder = os.path.abspath(folder)
        self.database_url = database_url
        self.api_key = api_key
        self.Server = server_class
        self.root = os.geteuid() == 0
        self.processes = []  # (name, Popen), stopped at the end of each part
        self.clusters = []

    # -- processes -----------------------------------------------------------

    def pg(self, tool, *args):
        """Runs a Postgres tool, as the `postgres` user when we are root."""
        command = [os.path.join(self.pg_bin, tool), *args]
        if self.root:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, cwd="/", capture_output=True, text=True, timeout=WAIT * 2)
        if done.returncode != 0:
            raise Failed(f"{tool} {' '.join(args)} failed: {(done.stderr or done.stdout).strip()[-500:]}")

    def own(self, path):
        """Makes PATH the postgres user's (when root), and every folder above it traversable."""
        if not self.root:
            return
        shutil.chown(path, "postgres", "postgres")
        current = path
        while current != "/":
            current = os.path.dirname(current)
            mode = os.stat(current).st_mode
            if not mode & 0o001:
                os.chmod(current, mode | 0o001)

    def spawn(self, name, folder, args, env):
        """Starts `oncepay ARGS` with ENV (and nothing from .env that ENV does not
        set: every setting the block depends on is given), logging to FOLDER/NAME.log."""
        log = open(os.path.join(folder, name + ".log"), "a")
        process = subprocess.Popen(
            [self.oncepay, *args],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=folder,
        )
        log.close()
        self.processes.append((name, process))
        with open(os.path.join(folder, name + ".pid"), "w") as f:
            f.write(f"{process.pid}\n")
        return process

    def stop(self, process):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = [(n, p) for n, p in self.processes if p is not process]

    def healthy(self, name, process, url):
        def check():
            if process.poll() is not None:
                raise Failed(f"{name} exited with status {process.returncode} (see its log)")
            server = self.Server(url, self.api_key)
            return server.healthy()

        until(f"{name} answering {url}/healthz", check)

    def clean_up(self):
        for _, process in list(self.processes):
            self.stop(process)
        for cluster in self.clusters:
            if cluster.running():
                try:
                    cluster.kill()
                except Failed:
                    pass
        self.clusters = []

    def leftovers(self, folder):
        """Stops what a run that did not end cleanly left in FOLDER: its Postgres
        servers, and oncepay processes by the pid files it wrote (only when the
        pid is still this binary)."""
        for name in ("primary", "standby"):
            data = os.path.join(folder, name, "data")
            if os.path.exists(os.path.join(data, "postmaster.pid")):
                try:
                    self.pg("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
                except Failed:
                    pass
        for name in ("oncepay", "processor"):
            try:
                with open(os.path.join(folder, name + ".pid")) as f:
                    pid = int(f.read().strip())
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[0].decode() == self.oncepay:
                        os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass

    # -- the block -----------------------------------------------------------

    def run(self, block, prefix):
        """Fills BLOCK (demo.py's Block) with both parts; PREFIX starts its run tags."""
        self.prefix = prefix
        for tool in ("initdb", "pg_ctl", "pg_basebackup"):
            if not os.access(os.path.join(self.pg_bin, tool), os.X_OK):
                raise Failed(f"no {tool} in {self.pg_bin} (install Debian's postgresql package)")
        block.row(
            "each part",
            "a primary and a streaming standby, the standby's WAL receiver stopped; a charge, "
            "the primary killed, the standby promoted, the client's retry",
        )
        try:
            self.part(block, synchronous=False)
            self.part(block, synchronous=True)
        finally:
            self.clean_up()

    def part(self, b, synchronous):
        name = "sync" if synchronous else "async"
        folder = os.path.join(self.folder, name)
        os.makedirs(folder, exist_ok=True)
        self.leftovers(folder)
        shutil.rmtree(folder)
        os.makedirs(os.path.join(folder, "primary"))
        os.makedirs(os.path.join(folder, "standby"))
        for sub in (folder, os.path.join(folder, "primary"), os.path.join(folder, "standby")):
            self.own(sub)
        try:
            self._part(b, synchronous, name, folder)
        finally:
            self.clean_up()

    def _part(self, b, synchronous, name, folder):
        if synchronous:
            b.part("synchronous replication (synchronous_standby_names, synchronous_commit = on)")
        else:
            b.part("asynchronous replication (the default)")
        b._numbers = {}  # each part numbers its charges from #1
        run, key = f"{self.prefix}-11-{name}", "demo-" + os.urandom(16).hex()
        b.runs.append(run)

        # The pair.
        primary = Postgres(self, os.path.join(folder, "primary"), free_port())
        standby = Postgres(self, os.path.join(folder, "standby"), free_port())
        # WAL segments of 1 MB instead of 16: a tenth of the files to write,
        # copy and remove, which a busy disk feels.
        self.pg(
            "initdb", "-N", "-D", primary.data, "--auth=trust", "-U", "postgres", "--encoding=UTF8", "--locale=C",
            "--wal-segsize=1",
        )
        # fsync off: the block kills processes, never the machine, so what the
        # kernel holds survives; and a standby's first start, or a promotion,
        # then skips syncing its whole data folder (seconds on a busy disk).
        common = {"listen_addresses": "'127.0.0.1'", "unix_socket_directories": "''", "fsync": "off"}
        primary.configure(port=primary.port, **common)
        if synchronous:
            primary.configure(synchronous_standby_names=f"'{STANDBY_NAME}'", synchronous_commit="on")
        self.clusters.append(primary)
        primary.start()
        # -R writes standby.signal and primary_conninfo; the copied
        # postgresql.conf is the primary's, so the standby's own lines follow.
        self.pg("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres", "-D", standby.data, "-R", "-X", "stream", "-c", "fast", "-N")
        standby.configure(
            port=standby.port,
            cluster_name=f"'{STANDBY_NAME}'",
            # A receiver started again connects within 0.1 s, not 5.
            wal_retrieve_retry_interval="'100ms'",
            # Once promoted it runs alone: with no standby to wait for, a
            # synchronous setting would hold every commit.
            synchronous_standby_names="''",
        )
        self.clusters.append(standby)
        standby.start()
        state = "sync" if synchronous else "async"
        until(
            f"the standby streaming from the primary ({state})",
            lambda: primary.sql(f"select sync_state from pg_stat_replication where application_name = '{STANDBY_NAME}' and state = 'streaming'") == state,
        )
        primary.sql("create database oncepay")
        b.row("the pair", f"primary 127.0.0.1:{primary.port}, standby 127.0.0.1:{standby.port}, streaming ({state})")

        # The card gateway, its ledger on a server that does not fail.
        ledger = url_with_database(self.database_url, f"{database_of(self.database_url)}_failover_{name}")
        # Emptied, when an earlier run left it: faster than dropping it (a
        # checkpoint of a shared server); the gateway makes it when missing.
        exists = psql(self.database_url, f"select count(*) from pg_database where datname = '{database_of(ledger)}'")
        if exists == "1":
            psql(ledger, "do $$ begin if to_regclass('operations') is not null then truncate operations; end if; end $$")
        processor_port = free_port()
        processor = self.spawn(
            "processor",
            folder,
            ["processor"],
            {
                "PROCESSOR_DATABASE_URL": ledger,
                "PROCESSOR_BIND_ADDR": "127.0.0.1",
                "PROCESSOR_PORT": str(processor_port),
                "PROCESSOR_LATENCY_MS": "0",
                "PROCESSOR_FAULT_INJECTION": "false",
            },
        )
        processor_url = f"http://127.0.0.1:{processor_port}"
        self.healthy("oncepay processor", processor, processor_url)
        # oncepay's account at the gateway: a new one for this scenario.
        processor_api_key = subprocess.run(
            [self.oncepay, "processor", "accounts", "create", "--name", f"oncepay failover {name} {time.time_ns()}"],
            env={**os.environ, "PROCESSOR_DATABASE_URL": ledger},
            capture_output=True,
            text=True,
            timeout=WAIT,
            check=True,
            cwd=folder,
        ).stdout.strip()

        def paid():
            """The payments in the ledger (money moved), and what they took."""
            row = psql(
                ledger,
                "select count(*) || ' ' || coalesce(sum(amount), 0) from operations "
                "where kind = 'authorization' and outcome = 'succeeded'",
            )
            return tuple(int(n) for n in row.split())

        # oncepay, on the primary.
        port = free_port()
        url = f"http://127.0.0.1:{port}"

        # Both hosts, the primary first: the server takes the writable one,
        # and moves to the other when it is promoted.
        database_url = (
            f"postgres://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/oncepay"
            "?target_session_attrs=read-write"
        )
        process = self.spawn(
            "oncepay",
            folder,
            ["serve"],
            {
                "DATABASE_URL": database_url,
                "DATABASE_PRIMARY_CHECK_INTERVAL": "100ms",
                "PROCESSOR_URL": processor_url,
                "PROCESSOR_API_KEY": processor_api_key,
                "PORT": str(port),
                "BIND_ADDR": "127.0.0.1",
                "DEMO_API_KEY": self.api_key,
                "FAULT_INJECTION": "false",
                "DEMO_UNSAFE_ENDPOINTS": "false",
                "IDEMPOTENCY_KEY_REQUIRED": "false",
                "PROCESSOR_LATENCY_MS": "0",
                "REDIS_URL": "",
            },
        )
        self.healthy("oncepay serve", process, url)
        server = self.Server(url, self.api_key)

        def ready(status):
            """Waits until oncepay's /readyz answers STATUS."""
            until(
                f"oncepay's /readyz answering {status}",
                lambda: process.poll() is None and server.request("GET", "/readyz", auth=False).status == status,
            )

        # Everything so far (the schema, the demo merchant) on the standby,
        # then its receiver stopped: what the primary writes next stays there.
        def caught_up():
            lsn = primary.sql("select pg_current_wal_lsn()")
            return standby.sql(f"select pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn") == "t"

        until("the standby caught up with the primary", caught_up)
        self.receiver(standby, on=False)
        b.row("the standby's WAL receiver", "stopped (primary_conninfo = ''): the standby falls behind")

        # The charge.
        if synchronous:
            answers = []

            def charge():
                try:
                    answers.append(server.charge(run, key))
                except Exception as e:  # told below, as the charge's answer
                    answers.append(e)

            request = threading.Thread(target=charge, daemon=True)
            request.start()
            def waiting():
                n = primary.sql("select count(*) from pg_stat_activity where wait_event = 'SyncRep'")
                return None if n == "0" else n

            waiting = until("the charge's commit waiting for the standby", waiting)
            if not request.is_alive():
                raise Failed("the charge was answered while the standby could not have it")
            b.row(
                "the charge (POST /v1/charges)",
                f"no answer yet: its commit waits for the standby (pg_stat_activity: {waiting} "
                f"backend{'' if waiting == '1' else 's'} in wait_event SyncRep)",
            )
            # The first commit that waits is the claim's, made before the
            # processor is called: no money has moved yet.
            b.row("payments in the processor's ledger by then", b.count("sync_payments_while_waiting", paid()[0], 0))
            self.receiver(standby, on=True)
            b.row("the standby's WAL receiver", "started again (primary_conninfo put back)")
            request.join(WAIT)
            if request.is_alive() or not answers:
                raise Failed(f"the charge got no answer within {WAIT} s of the standby's return")
            first = answers[0]
            if isinstance(first, Exception):
                raise Failed(f"the charge failed: {first}")
            b.row("the charge's answer", b.say(first))
        else:
            first = server.charge(run, key)
            b.row("the charge (POST /v1/charges)", b.say(first) + (" (201, acknowledged)" if first.status == 201 else ""))
        if first.status != 201:
            raise Failed(f"the charge answered {first.status} {first.body.get('code', '')}")

        # The failover.
        primary.kill()
        b.row("the primary", "killed (pg_ctl stop -m immediate)")
        ready(503)
        b.row("oncepay's /readyz", "503: no host of DATABASE_URL is writable")
        self.pg("pg_ctl", "-D", standby.data, "-w", "-t", str(WAIT), "promote")
        b.row("the standby", "promoted (pg_ctl promote): the new primary")
        ready(200)
        b.row("oncepay's /readyz", "200: the same process, on the new primary (multi-host DATABASE_URL)")

        charges = int(standby.sql(f"select count(*) from charges where metadata->>'demo_run' = '{run}'", "oncepay"))
        b.row("the charge on the new primary", b.count(f"{name}_charges_after_failover", charges, 1 if synchronous else 0))
        state = server.key_state(key)
        b.row(
            "the key on the new primary",
            state.body.get("status", "?") if state.status == 200 else ("unknown (404)" if state.status == 404 else str(state.status)),
        )

        # The client's retry.
        retried = time.monotonic()
        retry = server.charge(run, key)
        b.row("the client's retry (same key)", b.say(retry))
        charges = int(standby.sql(f"select count(*) from charges where metadata->>'demo_run' = '{run}'", "oncepay"))
        b.row("charges in oncepay's database", b.count(f"{name}_charges", charges, 1))
        payments, charged = paid()
        payments = b.count(f"{name}_payments", payments, 1 if synchronous else 2)
        b.row("payments in the processor's ledger", f"{payments} ({charged} charged)")

        # Reconciliation, once both payments are older than its in-flight age.
        time.sleep(max(0.0, retried + IN_FLIGHT_AGE + 0.2 - time.monotonic()))
        reconcile = subprocess.run(
            [self.oncepay, "reconcile", "--json", "--window", "1h"],
            env={
                **os.environ,
                "DATABASE_URL": database_url,
                "PROCESSOR_URL": processor_url,
                "PROCESSOR_API_KEY": processor_api_key,
                "PROCESSING_TIMEOUT": f"{int(IN_FLIGHT_AGE * 1000)}ms",
            },
            capture_output=True,
            text=True,
            timeout=WAIT * 2,
            cwd=folder,
        )
        try:
            report = json.loads(reconcile.stdout)
        except ValueError:
            raise Failed(f"oncepay reconcile exited {reconcile.returncode}: {reconcile.stderr.strip()[-500:]}") from None
        differences = report.get("differences", [])
        kinds = " | ".join(f"{d['kind']} {d['key']}: {d['detail']}" for d in differences)
        b.count(f"{name}_differences", len(differences), 0 if synchronous else 1)
        b.row(
            "oncepay reconcile",
            f"exit {reconcile.returncode}: {len(differences)} difference{'' if len(differences) == 1 else 's'}"
            + (f" ({kinds})" if kinds else ""),
        )
        b.count(f"{name}_reconcile_exit", reconcile.returncode, 0 if synchronous else 3)

    def receiver(self, standby, on):
        """Stops (ON false) or starts again the standby's WAL receiver."""
        if on:
            conninfo = standby.conninfo.replace("'", "''")
            standby.sql(f"alter system set primary_conninfo = '{conninfo}'")
        else:
            # What pg_basebackup -R wrote, to put back.
            standby.conninfo = standby.sql("show primary_conninfo")
            standby.sql("alter system set primary_conninfo = ''")
        standby.sql("select pg_reload_conf()")
        want = "1" if on else "0"
        until(
            f"the standby's WAL receiver {'running' if on else 'stopped'}",
            lambda: standby.sql("select count(*) from pg_stat_wal_receiver") == want,
        )
