#!/usr/bin/env python3
"""Figures for scripts/bench, with the standard library only.

    report.py pgbench LOG_PREFIX STDOUT_FILE SCENARIO CLIENTS
        One JSON line from a pgbench run: transactions/s from its output,
        p50/p99 from its per-transaction logs (LOG_PREFIX.*, latency in us).
    report.py statements JSON_FILE SCENARIO SIDE SCRIPT REQUESTS CLIENTS
        One JSON line from pg_stat_statements' rows (a JSON array of
        {calls, query}) counted over REQUESTS requests: statements per
        request, BEGIN/COMMIT apart, and each statement's share. For
        pgbench (SIDE pgbench, SCRIPT a file in bench/pgbench/), BEGIN and
        COMMIT are counted from the script: pgbench -M prepared sends them
        as prepared statements, whose executions pg_stat_statements (15)
        does not count after the first on each connection.
    report.py table RAW_JSONL OUT_DIR
        Prints the table, writes OUT_DIR/results.json, OUT_DIR/chart.dat and
        OUT_DIR/table.md, and draws OUT_DIR/throughput.png with gnuplot.
    report.py limits JSONL CHARGES_A RATE A_TIMES
        The two-merchant verdict of `scripts/bench limits`: B's latencies
        pooled over every window of B alone and over every window of B
        beside A (each window's histogram, "hist"), so that the p99 is taken
        from thousands of requests and the slow drift of a shared machine
        falls on both sides; each round's own figures too. Exits 1 when the
        target is not met.
    report.py soak CSV WARMUP TOLERANCE_PCT MARGIN_MIB OUT_MD
        The soak's verdicts, from the samples in CSV (one row per sample:
        run, cache_bytes, seconds, rss_kib, charges, refunds, deliveries; the
        sample at 0 s taken before the load starts). A run without replay
        cache passes if no sample after WARMUP seconds exceeds the one at
        WARMUP by more than TOLERANCE_PCT %; a run with the cache, if no
        sample exceeds the one at 0 s plus the cache's budget plus
        MARGIN_MIB, and from half the run on (by when the cache is full)
        stays within TOLERANCE_PCT % of its value then. Prints the verdicts and a table of the resident memory
        every minute, also written to OUT_MD; exits 1 if a run whose name
        does not start with "baseline" failed.
    report.py shed JSONL OUT_MD
        The overload runs of `scripts/bench shed` side by side, from the
        lines bench/wrk/shed.lua and the script wrote to JSONL: a table,
        printed and written to OUT_MD.
    report.py phases BEFORE AFTER SCENARIO CLIENTS CLIENT_MEAN_MS CLIENT_NON_2XX
        Where a new charge's time went in one run, from two scrapes of the
        service's /metrics (Prometheus text), before it and after it: from
        the deltas of the histograms' _sum and _count, the mean of each phase
        of the operation (operation_phase_duration_seconds, outcome
        executed), of the operation (operation_duration_seconds) and of the
        HTTP request (http_request_duration_seconds, status 201), and each
        one's share of the request's mean. CLIENT_MEAN_MS is wrk's mean
        latency over its CLIENT_NON_2XX non-2xx answers and the others, shown
        beside them. One JSON line on stdout; the table on
        stderr, with what is missing when the phases add up to under
        PHASES_GOAL of the request.
"""

import datetime
import glob
import json
import os
import platform
import re
import subprocess
import statistics
import sys

# Each scenario of the service, its anchor (side, scenario, label) and, where
# there is one, pgbench on the very SQL the service runs for it. A new
# charge crosses two systems: its anchor is a sum of parts (COMBINED).
SCENARIOS = [
    {"key": "new", "label": "new charges",
     "anchor": ("combined", "minimum", "minimum.sql + gateway.sql + HTTP hop"),
     "same": ("combined", "new", "new_charge.sql + gateway.sql + HTTP hop")},
    {"key": "replay", "label": "replays, cache hits",
     "anchor": ("ceiling", "ceiling", "HTTP ceiling"), "same": None},
    {"key": "replay_miss", "label": "replays, cache misses",
     "anchor": ("pgbench", "pk", "pk_lookup.sql"), "same": ("pgbench", "replay", "replay.sql")},
    {"key": "storm", "label": "retry storm",
     "anchor": ("pgbench", "storm", "storm mix, same SQL"), "same": None},
    # BENCH_BASELINE_BIN's new charges, replays from the cache and replays
    # missing it, each measured right after the service's: the same
    # anchors, so the two ratios compare the binaries.
    {"key": "new", "side": "baseline", "label": "new charges, BENCH_BASELINE_BIN",
     "anchor": ("combined", "minimum", "minimum.sql + gateway.sql + HTTP hop"),
     "same": ("combined", "new", "new_charge.sql + gateway.sql + HTTP hop")},
    {"key": "replay", "side": "baseline", "label": "replays, cache hits, BENCH_BASELINE_BIN",
     "anchor": ("ceiling", "ceiling", "HTTP ceiling"), "same": None},
    {"key": "replay_miss", "side": "baseline", "label": "replays, cache misses, BENCH_BASELINE_BIN",
     "anchor": ("pgbench", "pk", "pk_lookup.sql"), "same": ("pgbench", "replay", "replay.sql")},
]
# The new-charge anchors, each the sum of three parts measured one after the
# other at the same client count: oncepay's SQL on its database (pgbench),
# the gateway's statement on its own (pgbench, gateway.sql) and the bare
# HTTP hop (wrk against the ceiling serving a saved authorization). A client
# that did the three in turn would spend the sum of their latencies per
# charge, so at N clients its rate is N / (l1 + l2 + l3) = 1 / (1/r1 + 1/r2
# + 1/r3) (Little's law on each part); when each part saturates the
# machine, the same sum adds up what each charge costs it. The latencies
# add: p50 and p99 are the sums of the parts' (the p99's an upper bound).
COMBINED = {
    "minimum": [("pgbench", "minimum"), ("pgbench", "gateway"), ("hop", "hop")],
    "new": [("pgbench", "new"), ("pgbench", "gateway"), ("hop", "hop")],
}
LABELS = {s["key"]: s["label"] for s in SCENARIOS if "side" not in s}
LABELS["gateway"] = "new charges, the gateway's part"
# The client counts the targets are set at.
TARGET_CLIENTS = (8, 32, 128)
TRANSACTION_CONTROL = re.compile(r"^\s*(BEGIN|COMMIT|ROLLBACK|END|START\s+TRANSACTION)\b", re.I)
# A foreign-key check, run by Postgres itself (at commit, for oncepay's
# deferred keys), which pg_stat_statements shows as a top-level statement:
# no round trip.
FOREIGN_KEY_CHECK = re.compile(r"^SELECT (1|\$\d+) FROM ONLY \S+ x WHERE .* FOR KEY SHARE OF x$")


# The phases of a guarded operation, in the order a request meets them
# (crates/oncepay-core/src/operation/timing.rs); any other phase a scrape has comes after them.
PHASES = ["extract", "fingerprint", "key_read", "task_handoff", "pool_wait", "key_wait", "claim",
          "processor", "settle_pool_wait", "settle", "write", "render"]
# The share of the request's mean the phases should account for.
PHASES_GOAL = 0.90
SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
UNESCAPE = re.compile(r"\\(.)")


def parse_scrape(text):
    """The samples of a Prometheus text scrape: a list of (name, {label: value}, value)."""
    samples = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = {k: UNESCAPE.sub(lambda e: "\n" if e.group(1) == "n" else e.group(1), v)
                  for k, v in LABEL.findall(m.group(2) or "")}
        samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def histogram_delta(before, after, name, match):
    """The increase of the histogram `name`'s _sum and _count between two
    parsed scrapes, over every series whose labels include `match`."""
    def total(samples, part):
        return sum(v for n, labels, v in samples if n == f"{name}_{part}"
                   and all(labels.get(k) == want for k, want in match.items()))
    return (total(after, "sum") - total(before, "sum"), total(after, "count") - total(before, "count"))


def phase_breakdown(before_text, after_text, route="/v1/charges", outcome="executed", status="201"):
    """Each phase's mean and share of the HTTP request's mean, between two scrapes."""
    before, after = parse_scrape(before_text), parse_scrape(after_text)

    def mean_ms(delta):
        total, count = delta
        return round(total / count * 1000, 4) if count > 0 else None

    request = histogram_delta(before, after, "http_request_duration_seconds",
                              {"method": "POST", "route": route, "status": status})
    operation = histogram_delta(before, after, "operation_duration_seconds",
                                {"route": route, "outcome": outcome})
    request_ms, operation_ms = mean_ms(request), mean_ms(operation)
    found = {labels["phase"] for n, labels, _ in after if n == "operation_phase_duration_seconds_count"
             and labels.get("route") == route and labels.get("outcome") == outcome and "phase" in labels}
    phases = []
    for phase in [p for p in PHASES if p in found] + sorted(found - set(PHASES)):
        delta = histogram_delta(before, after, "operation_phase_duration_seconds",
                                {"route": route, "outcome": outcome, "phase": phase})
        if delta[1] <= 0:
            continue
        # Per operation, not per occurrence: a phase some operations skip
        # (a key read before the core) adds to the whole only as often as it ran.
        ms = mean_ms((delta[0], operation[1])) if operation[1] > 0 else mean_ms(delta)
        phases.append({"phase": phase, "count": int(delta[1]), "mean_ms": ms,
                       "share": round(ms / request_ms, 4) if request_ms else None})
    phases_ms = round(sum(p["mean_ms"] for p in phases), 4)
    share = (lambda ms: round(ms / request_ms, 4) if request_ms and ms is not None else None)
    in_handler = round(operation_ms - phases_ms, 4) if operation_ms is not None else None
    outside = round(request_ms - operation_ms, 4) if None not in (request_ms, operation_ms) else None
    return {
        "route": route, "outcome": outcome, "requests": int(request[1]),
        "operations": int(operation[1]),
        "request_mean_ms": request_ms, "operation_mean_ms": operation_ms,
        "operation_share": share(operation_ms),
        "phases": phases, "phases_mean_ms": phases_ms, "phases_share": share(phases_ms),
        "in_handler_outside_phases_ms": in_handler, "outside_handler_ms": outside,
    }


def phase_lines(b, label):
    """The breakdown `b` as a markdown table, with a verdict line."""
    pct = (lambda s: "" if s is None else f"{s * 100:.1f} %")
    lines = [f"{label}: where a request's time went, server side ({b['requests']} requests answered "
             f"201; means from the histograms' _sum/_count deltas; the request is "
             "http_request_duration_seconds, which leaves out hyper and the outermost layers)",
             "| phase | mean ms | share of the request's mean |", "| --- | ---: | ---: |"]
    lines += [f"| {p['phase']} | {p['mean_ms']:.3f} | {pct(p['share'])} |" for p in b["phases"]]
    rest = [("the phases together", b["phases_mean_ms"], b["phases_share"]),
            ("in the handler, outside the phases", b["in_handler_outside_phases_ms"],
             None if b["request_mean_ms"] is None or b["in_handler_outside_phases_ms"] is None
             else round(b["in_handler_outside_phases_ms"] / b["request_mean_ms"], 4)),
            ("outside the handler, in the layers around it", b["outside_handler_ms"],
             None if b["request_mean_ms"] is None or b["outside_handler_ms"] is None
             else round(b["outside_handler_ms"] / b["request_mean_ms"], 4)),
            ("the operation (operation_duration_seconds)", b["operation_mean_ms"], b["operation_share"]),
            ("the request (http_request_duration_seconds)", b["request_mean_ms"], 1.0 if b["request_mean_ms"] else None)]
    lines += [f"| {name} | {fmt(ms, 3)} | {pct(s)} |" for name, ms, s in rest]
    if b.get("client_mean_ms"):
        over = (f", over every answer, {b['client_non_2xx']} of them non-2xx"
                if b.get("client_non_2xx") else "")
        lines.append(f"| the client's mean (wrk{over}), for comparison | {b['client_mean_ms']:.3f} | "
                     f"{pct(round(b['client_mean_ms'] / b['request_mean_ms'], 4) if b['request_mean_ms'] else None)} |")
    lines.append(phase_verdict(b))
    return lines


def phase_verdict(b):
    """Whether the phases reach PHASES_GOAL of the request's mean, and if not what is missing."""
    if not b["requests"] or b["phases_share"] is None:
        return "phases: no request was measured"
    share = b["phases_share"]
    if share >= PHASES_GOAL:
        return f"phases: {share * 100:.1f} % of the request's mean (goal >= {PHASES_GOAL * 100:.0f} %): met"
    gap = round(b["request_mean_ms"] - b["phases_mean_ms"], 3)
    return (f"phases: {share * 100:.1f} % of the request's mean, under {PHASES_GOAL * 100:.0f} %: "
            f"{gap:.3f} ms a request is in no phase: {fmt(b['in_handler_outside_phases_ms'], 3)} ms in the "
            f"handler between phases, {fmt(b['outside_handler_ms'], 3)} ms outside the handler, in the "
            "layers around it that http_request_duration_seconds covers (the panic catcher, the "
            "timeout, the body limit, routing, and observe::finish's way out)")


def phases(before, after, scenario, clients, client_mean_ms, client_non_2xx):
    b = phase_breakdown(open(before).read(), open(after).read())
    b.update({"kind": "phases", "scenario": scenario, "side": "oncepay", "clients": int(clients),
              "client_mean_ms": float(client_mean_ms) if client_mean_ms not in ("", "None") else None,
              "client_non_2xx": int(client_non_2xx or 0)})
    print("\n".join(phase_lines(b, f"{LABELS.get(scenario, scenario)}, {clients} clients")), file=sys.stderr)
    print(json.dumps(b))


def percentile(sorted_values, p):
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, int(round(p / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


def pgbench(prefix, stdout_file, scenario, clients):
    text = open(stdout_file).read()
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", text)
    failed = re.search(r"number of failed transactions: (\d+)", text)
    latencies = []
    for path in glob.glob(prefix + ".*"):
        with open(path) as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3:
                    latencies.append(int(fields[2]) / 1000)
        os.remove(path)
    latencies.sort()
    print(json.dumps({
        "kind": "run", "side": "pgbench", "scenario": scenario, "clients": int(clients),
        "rps": float(tps.group(1)) if tps else 0.0,
        "p50_ms": round(percentile(latencies, 50), 3),
        "p99_ms": round(percentile(latencies, 99), 3),
        "max_ms": round(latencies[-1], 3) if latencies else 0.0,
        "transactions": len(latencies),
        "failed": int(failed.group(1)) if failed else 0,
    }))


def statements(json_file, scenario, side, script, requests, clients):
    rows = json.load(open(json_file))
    requests = int(requests)
    per = (lambda n: round(n / requests, 3)) if requests else (lambda n: None)
    listed, total = [], {"statement": 0, "transaction_control": 0, "foreign_key_check": 0}
    for row in rows:
        query = " ".join(row["query"].split())
        kind = ("transaction_control" if TRANSACTION_CONTROL.match(query)
                else "foreign_key_check" if FOREIGN_KEY_CHECK.match(query) else "statement")
        total[kind] += row["calls"]
        listed.append({"query": query, "calls": row["calls"], "per_request": per(row["calls"]), "kind": kind,
                       "mean_exec_ms": row.get("mean_ms")})
    begin_commit = per(total["transaction_control"])
    begin_commit_from = "pg_stat_statements"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pgbench", script)
    if side == "pgbench" and os.path.exists(path):
        begin_commit = sum(1 for line in open(path)
                           if re.match(r"^\s*(BEGIN|COMMIT|ROLLBACK|END)\s*;\s*$", line, re.I))
        begin_commit_from = script
    statements_per_request = per(total["statement"])
    print(json.dumps({
        "kind": "statements", "scenario": scenario, "side": side, "script": script,
        "clients": int(clients), "requests": requests,
        "statements_per_request": statements_per_request,
        "begin_commit_per_request": begin_commit, "begin_commit_counted_from": begin_commit_from,
        "round_trips_per_request": None if statements_per_request is None
        else round(statements_per_request + begin_commit, 3),
        "foreign_key_checks_per_request": per(total["foreign_key_check"]),
        "statements": listed,
    }))


def machine():
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}"


def ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def fmt(value, digits=0):
    return "" if value is None else f"{value:.{digits}f}"


def table(raw_path, out_dir):
    rows = [json.loads(line) for line in open(raw_path) if line.strip()]
    runs = [r for r in rows if r.get("kind") == "run"]
    extras = [r for r in rows if r.get("kind") == "extra"]
    counts = [r for r in rows if r.get("kind") == "statements"]
    breakdowns = [r for r in rows if r.get("kind") == "phases"]
    meta = next((r for r in rows if r.get("kind") == "meta"), {})

    def find(side, scenario, clients):
        return next((r for r in runs if r["side"] == side and r["scenario"] == scenario
                     and r["clients"] == clients), None)

    clients_list = sorted({r["clients"] for r in runs})
    for name, parts in COMBINED.items():
        for c in clients_list:
            found = [find(side, scenario, c) for side, scenario in parts]
            if all(r and r["rps"] > 0 for r in found):
                runs.append({
                    "kind": "run", "side": "combined", "scenario": name, "clients": c,
                    "rps": round(1 / sum(1 / r["rps"] for r in found), 1),
                    "p50_ms": round(sum(r["p50_ms"] for r in found), 3),
                    "p99_ms": round(sum(r["p99_ms"] for r in found), 3),
                    "parts": {f"{side} {scenario}": r["rps"] for (side, scenario), r in zip(parts, found)},
                })
    results = []
    lines = ["| scenario | clients | oncepay req/s | p50 ms | p99 ms | non-2xx | anchor | anchor /s "
             "| p50 ms | p99 ms | ratio | p99 ratio | same SQL | same SQL tx/s | ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: "
             "| --- | ---: | ---: |"]
    for sc in SCENARIOS:
        for c in clients_list:
            side = sc.get("side", "oncepay")
            s = find(side, sc["key"], c)
            if not s:
                continue
            a = find(sc["anchor"][0], sc["anchor"][1], c) or {}
            same = find(sc["same"][0], sc["same"][1], c) if sc["same"] else None
            entry = {
                "scenario": sc["key"], "side": side, "clients": c,
                "rps": s["rps"], "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"],
                "non_2xx": s.get("non_2xx", 0), "socket_errors": s.get("socket_errors", 0),
                "anchor": sc["anchor"][2], "anchor_rps": a.get("rps"),
                "anchor_p50_ms": a.get("p50_ms"), "anchor_p99_ms": a.get("p99_ms"),
                "ratio": ratio(s["rps"], a.get("rps")),
                "p99_ratio": ratio(s["p99_ms"], a.get("p99_ms")),
            }
            if same is not None or sc["same"]:
                same = same or {}
                entry.update({"same_sql": sc["same"][2], "same_sql_rps": same.get("rps"),
                              "same_sql_p50_ms": same.get("p50_ms"), "same_sql_p99_ms": same.get("p99_ms"),
                              "ratio_to_same_sql": ratio(s["rps"], same.get("rps"))})
            results.append(entry)
            lines.append(
                f"| {sc['label']} | {c} | {s['rps']:.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} "
                f"| {entry['non_2xx']} | {sc['anchor'][2]} | {fmt(a.get('rps'))} | {fmt(a.get('p50_ms'), 2)} "
                f"| {fmt(a.get('p99_ms'), 2)} | {fmt(entry['ratio'], 2)} | {fmt(entry['p99_ratio'], 2)} "
                f"| {entry.get('same_sql', '')} | {fmt(entry.get('same_sql_rps'))} "
                f"| {fmt(entry.get('ratio_to_same_sql'), 2)} |")
    parts = [(c, find("pgbench", "minimum", c), find("pgbench", "new", c), find("pgbench", "gateway", c),
              find("hop", "hop", c)) for c in clients_list]
    parts = [p for p in parts if any(p[1:])]
    if parts:
        lines += ["", "the new-charge anchors' parts, measured one after the other: transactions "
                  "(or requests) per second, p99 ms; each anchor is 1 / the sum of 1 / its parts' rates",
                  "| clients | minimum.sql (oncepay's DB) | new_charge.sql (oncepay's DB) "
                  "| gateway.sql (the gateway's DB) | bare HTTP hop |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {c} | " + " | ".join(f"{r['rps']:.0f}, {r['p99_ms']:.2f}" if r else ""
                                           for r in rs) + " |" for c, *rs in parts]
    ceiling = [{"clients": c, "rps": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                "non_2xx": r.get("non_2xx", 0)}
               for c in clients_list for r in [find("ceiling", "ceiling", c)] if r]

    # Round trips per request, from pg_stat_statements.
    def count(scenario, side, script=None):
        return next((r for r in counts if r["scenario"] == scenario and r["side"] == side
                     and (script is None or r["script"] == script)), None)

    round_trips = {}
    for key, scenario, side in [("round_trips_per_new_charge", "new", "oncepay"),
                                ("round_trips_per_new_charge_at_the_gateway", "new", "gateway"),
                                ("round_trips_per_replay", "replay", "oncepay"),
                                ("round_trips_per_replay_miss", "replay_miss", "oncepay")]:
        r = count(scenario, side)
        round_trips[key] = r["round_trips_per_request"] if r else None
    rt_lines = []
    warnings = []
    if counts:
        rt_clients = counts[0]["clients"]
        rt_lines += ["", f"round trips per request, counted by pg_stat_statements at {rt_clients} clients: "
                     "statements, BEGIN/COMMIT apart (pgbench's from its script), and the foreign-key "
                     "checks Postgres runs itself (no round trip); the counting queries left out",
                     "| scenario | ran | requests | statements | BEGIN/COMMIT | round trips | FK checks |",
                     "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in counts:
            ran = {"oncepay": "oncepay", "gateway": "oncepay processor (its database)"}.get(
                r["side"], f"pgbench {r['script']}")
            rt_lines.append(f"| {LABELS.get(r['scenario'], r['scenario'])} | {ran} | {r['requests']} "
                            f"| {fmt(r['statements_per_request'], 2)} | {fmt(r['begin_commit_per_request'], 2)} "
                            f"| {fmt(r['round_trips_per_request'], 2)} "
                            f"| {fmt(r['foreign_key_checks_per_request'], 2)} |")
        for r in counts:
            who = {"oncepay": "oncepay", "gateway": "the gateway"}.get(r["side"], f"pgbench {r['script']}")
            rt_lines += ["", f"per statement, {who}, {LABELS.get(r['scenario'], r['scenario'])} "
                         f"({r['requests']} requests): calls per request, mean execution ms in Postgres "
                         "(pg_stat_statements' mean_exec_time: neither the round trip nor the wait for "
                         "the commit's WAL flush), statement"]
            shown = [st for st in r["statements"] if st["per_request"] and st["per_request"] >= 0.001]
            rt_lines += [f"  {st['per_request']:7.3f}  "
                         f"{'' if st.get('mean_exec_ms') is None else format(st['mean_exec_ms'], '8.3f')}  "
                         f"{'(foreign-key check, no round trip) ' if st['kind'] == 'foreign_key_check' else ''}"
                         f"{st['query'][:100]}" for st in shown]
            if len(shown) < len(r["statements"]):
                rt_lines.append(f"  (and {len(r['statements']) - len(shown)} statements of fewer than "
                                "0.001 calls per request)")
        service, mirror = count("new", "oncepay"), count("new", "pgbench", "new_charge.sql")
        if service and mirror and service["round_trips_per_request"] is not None \
                and mirror["round_trips_per_request"] is not None:
            for field, what in [("statements_per_request", "statements"),
                                ("begin_commit_per_request", "BEGIN/COMMIT")]:
                if abs(service[field] - mirror[field]) > 0.25:
                    warnings.append(
                        f"warning: new_charge.sql no longer mirrors the service: {what} per request "
                        f"{service[field]:.2f} in oncepay, {mirror[field]:.2f} in new_charge.sql; "
                        "update bench/pgbench/new_charge.sql from src/")
        gateway, mirror = count("new", "gateway"), count("gateway", "pgbench", "gateway.sql")
        if gateway and mirror and gateway["statements_per_request"] is not None \
                and mirror["statements_per_request"] is not None \
                and abs(gateway["statements_per_request"] - mirror["statements_per_request"]) > 0.25:
            warnings.append(
                f"warning: gateway.sql no longer mirrors the gateway: statements per new charge "
                f"{gateway['statements_per_request']:.2f} at the gateway, "
                f"{mirror['statements_per_request']:.2f} in gateway.sql; update bench/pgbench/gateway.sql")

    # Where a new charge's time went, phase by phase, at each client count.
    phase_text = []
    for b in breakdowns:
        phase_text += [""] + phase_lines(b, f"{LABELS.get(b['scenario'], b['scenario'])}, "
                                            f"{b['clients']} clients")

    # The performance targets, where the figures exist.
    targets = []

    def target(name, value, goal, met):
        targets.append({"target": name, "value": value, "goal": goal, "met": met})

    if breakdowns:
        shares = {b["clients"]: b["phases_share"] for b in breakdowns if b["phases_share"] is not None}
        if shares:
            target("a new charge's phases / its request's mean (by clients)",
                   ", ".join(f"{c}: {v:.2f}" for c, v in shares.items()),
                   f">= {PHASES_GOAL:.2f}", all(v >= PHASES_GOAL for v in shares.values()))

    def at_clients(scenario, field, goal, good):
        picked = [r for r in results if r["scenario"] == scenario and r["side"] == "oncepay"
                  and r["clients"] in TARGET_CLIENTS and r.get(field) is not None]
        if not picked:
            return None
        values = {r["clients"]: r[field] for r in picked}
        shown = ", ".join(f"{c}: {v:.2f}" for c, v in values.items())
        return shown, goal, all(good(c, v) for c, v in values.items())

    # Each goal by client count (a goal for one count applies to that count).
    for name, scenario, field, goal, good in [
        ("new charges / minimum.sql + gateway.sql + HTTP hop", "new", "ratio", ">= 0.9",
         lambda c, v: v >= 0.9),
        ("new-charge p99 / the anchor's p99", "new", "p99_ratio", "<= 1.5", lambda c, v: v <= 1.5),
        ("replays from the cache / the HTTP ceiling", "replay", "ratio", ">= 0.8", lambda c, v: v >= 0.8),
        ("replays missing the cache / pk_lookup.sql", "replay_miss", "ratio",
         ">= 0.6 at 8 clients, >= 1.0 at more", lambda c, v: v >= (0.6 if c <= 8 else 1.0)),
    ]:
        t = at_clients(scenario, field, goal, good)
        if t:
            target(f"{name} (by clients)", t[0], t[1], t[2])
    # The service against BENCH_BASELINE_BIN, at each client count of one run:
    # new charges held to a goal, replays reported.
    for key, label, goal, good in [
        ("new", "new charges / BENCH_BASELINE_BIN's new charges", ">= 0.8", lambda v: v >= 0.8),
        ("replay", "replays from the cache / BENCH_BASELINE_BIN's", "reported", lambda v: True),
        ("replay_miss", "replays missing the cache / BENCH_BASELINE_BIN's", "reported", lambda v: True),
    ]:
        versus = {}
        for c in TARGET_CLIENTS:
            mine, theirs = find("oncepay", key, c), find("baseline", key, c)
            if mine and theirs and theirs["rps"]:
                versus[c] = ratio(mine["rps"], theirs["rps"])
        if versus:
            target(f"{label} (by clients)", ", ".join(f"{c}: {v:.2f}" for c, v in versus.items()),
                   goal, all(good(v) for v in versus.values()))
    for key, what in [("round_trips_per_new_charge", "new charge"),
                      ("round_trips_per_new_charge_at_the_gateway", "new charge at the gateway"),
                      ("round_trips_per_replay", "replay"),
                      ("round_trips_per_replay_miss", "replay missing the cache")]:
        if round_trips[key] is not None:
            target(f"round trips per {what} (pg_stat_statements)", round_trips[key], "reported", True)
    for e in extras:
        if e["name"] == "big_table":
            r = ratio(e["rps"], e["baseline_rps"])
            target(f"new charges with {e['rows']} keys / empty table (32 clients)", r, ">= 0.90", r >= 0.90)
        if e["name"] == "sweeper":
            r = ratio(e["p99_ms"], e["baseline_p99_ms"])
            target(f"new-charge p99 over the whole deletion of {e['expired_rows']} expired keys / baseline "
                   "(32 clients)", r, "<= 1.5", e["cleared"] and r is not None and r <= 1.5)
            target("the sweeper under load: time to clear the backlog (s), expired keys deleted per second",
                   f"{e['clear_seconds'] if e['cleared'] else 'not cleared'}, {e['keys_per_s']}",
                   "reported", e["cleared"])
        if e["name"] == "memory":
            target(f"server RSS with {e['connections']} connections (MiB)", e["rss_peak_mib"], "reported", True)
        if e["name"] == "replay_cache_memory":
            target(f"server RSS peak over {e['charges']} large charges and their replays, {e['label']} (MiB)",
                   e["rss_peak_mib"], f"<= {e['limit_mib']} (replay cache budget + 64)",
                   e["rss_peak_mib"] <= e["limit_mib"])
        if e["name"] == "deletion":
            target(f"expired keys deleted per second ({e['rows']} keys, {e['passes']} sweep passes)",
                   e["keys_per_s"], "reported", True)
            # One pass per SWEEP_INTERVAL (5 s by default), each deleting what
            # its time budget allows: the most one sweeper removes for good.
            pass_s = e["first_pass_seconds"]
            sustained = round(e["first_pass_deleted"] / (5 + pass_s)) if e["passes"] > 1 else None
            target("expired keys deleted per second, sustained at SWEEP_INTERVAL=5s (one pass's worth / (5 s + pass))",
                   sustained if sustained is not None else "backlog cleared in one pass",
                   "> 2000 (20 x 500 per pass before)", sustained is None or sustained > 2000)

    date = meta.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    summary = {
        "date": date,
        "machine": meta.get("machine") or machine(),
        "postgres": meta.get("postgres"),
        "commit": meta.get("commit"),
        "pool_size": meta.get("pool_size"),
        "pool_trials": meta.get("pool_trials", []),
        "seconds_per_run": meta.get("seconds"),
        "results": results,
        "ceiling": ceiling,
        **round_trips,
        "round_trips": counts,
        "phase_breakdown": breakdowns,
        "raw": runs,
        "extras": extras,
        "targets": targets,
        "warnings": warnings,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=2)

    text = [f"oncepay benchmark, {date}; {summary['machine']}; Postgres {summary['postgres']}; "
            f"commit {summary['commit']}; pool {summary['pool_size']}; {summary['seconds_per_run']} s per run",
            "ratio = oncepay req/s / the anchor's (pgbench tx/s, or the HTTP ceiling's req/s); "
            "p99 ratio = oncepay p99 / the anchor's p99; same SQL = pgbench on the statements the "
            "service runs; latencies in milliseconds", ""]
    text += lines
    text += rt_lines
    text += phase_text
    if summary["pool_trials"]:
        text += [""] + pool_trial_lines(summary["pool_trials"], summary["pool_size"])
    plain = [e for e in extras if e["name"] != "replay_cache_memory"]
    if plain:
        text += [""]
        for e in plain:
            text.append("extra: " + ", ".join(f"{k}={v}" for k, v in e.items() if k != "kind"))
    memory = [e for e in extras if e["name"] == "replay_cache_memory"]
    if memory:
        m = memory[0]
        text += ["", f"replay cache memory: {m['charges']} charges with the largest metadata "
                 f"({m['answer_bytes']}-byte answers), then one replay of each; REPLAY_CACHE_BYTES "
                 f"{m['budget_mib']} MiB; server VmRSS in MiB",
                 "| build | start | after creates | after replays | peak | limit | under limit "
                 "| creates/s | replays/s | unexpected answers |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        text += [f"| {e['label']} | {e['rss_start_mib']} | {e['rss_after_create_mib']} "
                 f"| {e['rss_after_replay_mib']} | {e['rss_peak_mib']} | {e['limit_mib']} "
                 f"| {'yes' if e['under_limit'] else 'no'} | {e['create_rps']:.0f} | {e['replay_rps']:.0f} "
                 f"| {e['unexpected_answers']} |" for e in memory]
    if targets:
        text += ["", "| target | figure | goal | met |", "| --- | ---: | --- | --- |"]
        text += [f"| {t['target']} | {t['value']} | {t['goal']} | {'yes' if t['met'] else 'no'} |"
                 for t in targets]
    if warnings:
        text += [""] + warnings
    output = "\n".join(text)
    print(output)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(output + "\n")

    # Chart data: one block per series, for gnuplot's `index` (bench/chart.gp
    # names them in this order).
    series = [("oncepay", "new"), ("combined", "minimum"), ("combined", "new"),
              ("oncepay", "replay"), ("ceiling", "ceiling"),
              ("oncepay", "replay_miss"), ("pgbench", "pk"), ("pgbench", "replay"),
              ("oncepay", "storm"), ("pgbench", "storm")]
    with open(os.path.join(out_dir, "chart.dat"), "w") as f:
        for side, scenario in series:
            f.write(f"# {side} {scenario}\n")
            for c in clients_list:
                r = find(side, scenario, c)
                f.write(f"{c} {r['rps'] if r else 'NaN'}\n")
            f.write("\n\n")
    if clients_list and any(not find("oncepay", scenario, clients_list[0])
                            for scenario in ("new", "replay", "replay_miss", "storm")):
        print("\nno chart: it needs every scenario (BENCH_SCENARIOS)", file=sys.stderr)
        return
    chart = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chart.gp")
    png = os.path.join(out_dir, "throughput.png")
    try:
        subprocess.run(["gnuplot", "-e", f"data='{out_dir}/chart.dat'; out='{png}'; "
                        f"subtitle='{date}, {os.cpu_count()} cores, pool {summary['pool_size']}'", chart],
                       check=True)
        print(f"\nchart: {png}")
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"\nno chart: gnuplot failed ({e})", file=sys.stderr)


def soak(csv_path, warmup, tolerance_pct, margin_mib, out_md):
    warmup, tolerance, margin = int(warmup), float(tolerance_pct) / 100, int(margin_mib) << 10
    runs = {}
    with open(csv_path) as f:
        header = f.readline().strip().split(",")
        for line in f:
            row = dict(zip(header, line.strip().split(",")))
            run = runs.setdefault(row["run"], {"cache_bytes": int(row["cache_bytes"]), "samples": []})
            run["samples"].append({k: int(row[k]) for k in header if k != "run"})
    failed = False
    lines = []
    for name, run in runs.items():
        samples = run["samples"]
        idle = samples[0]["rss_kib"]
        after = [s for s in samples if s["seconds"] >= warmup]
        if len(after) < 2:
            lines.append(f"{name}: too short for a verdict (warm-up {warmup} s)")
            failed |= not name.startswith("baseline")
            continue
        ref, last = after[0], after[-1]
        worst = max(s["rss_kib"] for s in after)
        # The least-squares slope over the run's second half (a filling cache
        # is full by then), and what it comes to per new charge made in it.
        half = [s for s in samples if s["seconds"] >= last["seconds"] / 2]
        n = len(half)
        mt = sum(s["seconds"] for s in half) / n
        mr = sum(s["rss_kib"] for s in half) / n
        var = sum((s["seconds"] - mt) ** 2 for s in half)
        slope = sum((s["seconds"] - mt) * (s["rss_kib"] - mr) for s in half) / var if var else 0.0
        made = half[-1]["charges"] - half[0]["charges"]
        per_charge = slope * (half[-1]["seconds"] - half[0]["seconds"]) * 1024 / made if made else 0.0
        trend = (f"after {warmup} s: {ref['rss_kib'] / 1024:.1f} MiB, at most {worst / 1024:.1f} MiB "
                 f"({(worst / ref['rss_kib'] - 1) * 100:+.1f} %); from {half[0]['seconds']} s on, "
                 f"{slope * 60:+.0f} KiB/min ({per_charge:+.0f} bytes per new charge)")
        if run["cache_bytes"] == 0:
            ok = worst <= ref["rss_kib"] * (1 + tolerance)
            rule = f"within {tolerance_pct} % of the value at {warmup} s"
        else:
            limit = idle + (run["cache_bytes"] >> 10) + margin
            highest = max(s["rss_kib"] for s in samples)
            # The cache is full by half the run (at the soak's defaults), so
            # from then on the memory must level off as without it.
            mid = half[0]
            settled = max(s["rss_kib"] for s in half)
            ok = highest <= limit and settled <= mid["rss_kib"] * (1 + tolerance)
            rule = (f"at most {limit / 1024:.1f} MiB, {idle / 1024:.1f} at start + the budget "
                    f"{run['cache_bytes'] / 2**20:.0f} MiB + {margin_mib} MiB: {highest / 1024:.1f}; "
                    f"from {mid['seconds']} s on within {tolerance_pct} % of "
                    f"{mid['rss_kib'] / 1024:.1f} MiB: {(settled / mid['rss_kib'] - 1) * 100:+.1f} %")
        failed |= not ok and not name.startswith("baseline")
        lines.append(f"{name}: {'PASS' if ok else 'FAIL'} ({rule}); {trend}; "
                     f"{last['charges']} charges, {last['refunds']} refunds, "
                     f"{last['deliveries']} deliveries")
    for line in lines:
        print(line)
    # Resident memory every minute, one column per run.
    names = list(runs)
    times = sorted({s["seconds"] for r in runs.values() for s in r["samples"] if s["seconds"] % 60 == 0})
    table = ["| s | " + " | ".join(f"{n} MiB" for n in names) + " |",
             "| ---: | " + " | ".join("---:" for _ in names) + " |"]
    for t in times:
        cells = []
        for n in names:
            s = next((s for s in runs[n]["samples"] if s["seconds"] == t), None)
            cells.append(f"{s['rss_kib'] / 1024:.1f}" if s else "")
        table.append(f"| {t} | " + " | ".join(cells) + " |")
    print("\nresident memory (VmRSS) every minute:\n" + "\n".join(table))
    with open(out_md, "w") as f:
        f.write("\n".join(lines) + "\n\n" + "\n".join(table) + "\n")
    sys.exit(1 if failed else 0)


def shed(jsonl_path, out_md):
    """The overload runs of `scripts/bench shed`, side by side."""
    runs, written = [], {}
    with open(jsonl_path) as f:
        for line in f:
            row = json.loads(line)
            if row["kind"] == "shed":
                runs.append(row)
            elif row["kind"] == "written":
                written[row["side"]] = row["charges"]
    head = ["run", "answered/s", "201/s", "shed (503 overloaded)", "201 p50 ms", "201 p99 ms",
            "shed p50 ms", "shed p99 ms", "other answers", "socket errors", "charges written"]
    rows = []
    for r in runs:
        other = ", ".join(f"{k}: {v}" for k, v in sorted(r["other"].items())) or "none"
        share = r["shed"] / r["answered"] * 100 if r["answered"] else 0.0
        rows.append([r["side"], f"{r['rps']:.0f}", f"{r['created_rps']:.0f}",
                     f"{share:.1f} % ({r['shed']})", f"{r['created_p50_ms']:.1f}",
                     f"{r['created_p99_ms']:.1f}",
                     f"{r['shed_p50_ms']:.1f}" if r["shed"] else "",
                     f"{r['shed_p99_ms']:.1f}" if r["shed"] else "",
                     other, str(r["socket_errors"]),
                     f"{written.get(r['side'], '?')} ({r['created']} answered 201)"])
    clients = runs[0]["clients"] if runs else 0
    seconds = runs[0]["seconds"] if runs else 0
    lines = [f"new charges from {clients} connections, {seconds:.0f} s per run:", "",
             "| " + " | ".join(head) + " |",
             "| --- | " + " | ".join("---:" for _ in head[1:-2]) + " | ---: | ---: |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    with open(out_md, "w") as f:
        f.write(text)


def pool_trial_lines(trials, pool_size):
    """The pool trial as a table: the median new charges/s (and p99) of its
    rounds, by pool and clients, each round's figures after it."""
    pools = sorted({t["pool"] for t in trials})
    clients = sorted({t.get("clients", 32) for t in trials})
    runs = {}
    for t in trials:
        runs.setdefault((t["pool"], t.get("clients", 32)), []).append(t)
    rounds = max(len(r) for r in runs.values())
    lines = [f"pool trial: new charges/s (and the median p99 in ms), the median of {rounds} round(s), by "
             f"DATABASE_MAX_CONNECTIONS; the matrix ran with {pool_size}",
             "", "| pool | " + " | ".join(f"{c} clients" for c in clients) + " | each round's req/s |",
             "| ---: | " + " | ".join("---:" for _ in clients) + " | --- |"]
    for p in pools:
        cells, each = [], []
        for c in clients:
            r = runs.get((p, c), [])
            if not r:
                cells.append("")
                continue
            p99s = [x["p99_ms"] for x in r if "p99_ms" in x]
            p99 = f" ({statistics.median(p99s):.1f})" if p99s else ""
            cells.append(f"{statistics.median(x['rps'] for x in r):.0f}{p99}")
            each.append(f"{c}: " + " / ".join(f"{x['rps']:.0f}" for x in r))
        lines.append(f"| {p} | " + " | ".join(cells) + " | " + "; ".join(each) + " |")
    return lines


def pooled_percentile(hist, p):
    """The p-th percentile of [value, count] pairs, as `percentile` takes it."""
    pairs = sorted(hist)
    total = sum(n for _, n in pairs)
    if not total:
        return 0.0
    rank = max(1, min(total, int(round(p / 100 * total + 0.5))))
    seen = 0
    for value, n in pairs:
        seen += n
        if seen >= rank:
            return value
    return pairs[-1][0]


def limits(jsonl_path, charges_a, rate, a_times):
    """B alone against B beside A, pooled over the windows, and A's answers."""
    rows = [json.loads(line) for line in open(jsonl_path)]
    charges_a, rate, a_times = int(charges_a), int(rate), int(a_times)
    b = [r for r in rows if r["side"] == "b"]
    a = [r for r in rows if r["side"] == "a"]

    def pool(window):
        runs = [r for r in b if r["window"] == window]
        hist = [pair for r in runs for pair in r["hist"]]
        seconds = sum(r["seconds"] for r in runs)
        return {
            "windows": len(runs),
            "requests": sum(r["requests"] for r in runs),
            "created_rps": sum(r["created"] for r in runs) / seconds if seconds else 0.0,
            "p50_ms": pooled_percentile(hist, 50) / 1000,
            "p99_ms": pooled_percentile(hist, 99) / 1000,
            "non_201": sum(n for r in runs for s, n in r["by_status"].items() if s != "201"),
            "server_cpu": sum(r["server_cpu_ms"] for r in runs) / seconds if seconds else 0.0,
            "gateway_cpu": sum(r["gateway_cpu_ms"] for r in runs) / seconds if seconds else 0.0,
        }

    alone, both = pool("alone"), pool("both")
    tput = both["created_rps"] / alone["created_rps"] if alone["created_rps"] else 0.0
    p99 = both["p99_ms"] / alone["p99_ms"] if alone["p99_ms"] else float("inf")
    lines = ["B's windows, each round (its own p99 from a few hundred requests: noisy alone):", "",
             "| round | window | B 201/s | B p50 ms | B p99 ms | A sent/s | A 201/s | A 429 | A 5xx |"
             " oncepay CPU ms/s | gateway CPU ms/s |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in b:
        mate = next((x for x in a if x["round"] == r["round"] and x["window"] == r["window"]), None)
        a_cells = (f"{mate['rps']:.0f} | {mate['created_rps']:.0f} | {mate['by_status'].get('429', 0)} | "
                   f"{sum(n for s, n in mate['by_status'].items() if s.startswith('5'))}"
                   if mate else "- | - | - | -")
        lines.append(f"| {r['round']} | {'beside A' if r['window'] == 'both' else 'alone'} | "
                     f"{r['created_rps']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {a_cells} | "
                     f"{r['server_cpu_ms'] / r['seconds']:.0f} | {r['gateway_cpu_ms'] / r['seconds']:.0f} |")
    lines += ["", "B pooled over its windows:", "",
              "| B | windows | requests | 201/s | p50 ms | p99 ms | answers not 201 | oncepay CPU ms/s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in (("alone", alone), ("beside A", both)):
        lines.append(f"| {name} | {r['windows']} | {r['requests']} | {r['created_rps']:.1f} | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['non_201']} | {r['server_cpu']:.0f} |")
    a_201 = sum(r["created"] for r in a)
    a_429 = sum(r["by_status"].get("429", 0) for r in a)
    a_5xx = sum(n for r in a for s, n in r["by_status"].items() if s.startswith("5"))
    a_errors = sum(r["socket_errors"] for r in a)
    lines += ["", f"limit {rate}/s per merchant, A at {a_times} times it. B beside A / B alone: "
              f"throughput {tput:.3f}, p99 {p99:.3f} (target: within 10 %). A: {a_201} answered 201, "
              f"{charges_a} charges in the database, {a_429} answered 429, {a_5xx} 5xx, "
              f"{a_errors} socket errors."]
    # wrk drops the answers of the requests in flight when it stops: one per
    # connection at most (20 for A), in each of A's windows.
    ok = abs(1 - tput) <= 0.10 and p99 <= 1.10 and alone["non_201"] == 0 and both["non_201"] == 0
    if a_times > 0:
        ok = (ok and a_5xx == 0 and a_errors == 0 and a_201 <= charges_a <= a_201 + 20 * len(a)
              and (a_times == 1 or a_429 > 0))
    lines.append("verdict: " + ("met" if ok else "NOT met"))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "pgbench":
        pgbench(*sys.argv[2:])
    elif len(sys.argv) == 8 and sys.argv[1] == "statements":
        statements(*sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 7 and sys.argv[1] == "soak":
        soak(*sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "shed":
        shed(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 6 and sys.argv[1] == "limits":
        sys.exit(limits(*sys.argv[2:]))
    elif len(sys.argv) == 8 and sys.argv[1] == "phases":
        phases(*sys.argv[2:])
    else:
        sys.exit(__doc__)
