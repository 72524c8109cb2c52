#!/usr/bin/env python3
"""Figures for scripts/bench, with the standard library only.

    report.py pgbench LOG_PREFIX STDOUT_FILE SCENARIO CLIENTS
        One JSON line from a pgbench run: transactions/s from its output,
        p50/p99 from its per-transaction logs (LOG_PREFIX.*, latency in us).
    report.py table RAW_JSONL OUT_DIR
        Prints the table, writes OUT_DIR/results.json, OUT_DIR/chart.dat and
        OUT_DIR/table.md, and draws OUT_DIR/throughput.png with gnuplot.
"""

import datetime
import glob
import json
import os
import platform
import re
import subprocess
import sys

SCENARIOS = [
    ("new", "new charges", "new"),
    ("replay", "replays", "replay"),
    ("storm", "retry storm", "storm"),
]


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
    return round(a / b, 2) if b else None


def table(raw_path, out_dir):
    rows = [json.loads(line) for line in open(raw_path) if line.strip()]
    runs = [r for r in rows if r.get("kind") == "run"]
    extras = [r for r in rows if r.get("kind") == "extra"]
    meta = next((r for r in rows if r.get("kind") == "meta"), {})

    def find(side, scenario, clients):
        return next((r for r in runs if r["side"] == side and r["scenario"] == scenario
                     and r["clients"] == clients), None)

    clients_list = sorted({r["clients"] for r in runs})
    results = []
    header = ("| scenario | clients | oncepay req/s | p50 ms | p99 ms | pgbench tx/s | p50 ms | p99 ms "
              "| ratio | non-2xx |")
    lines = [header, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for scenario, label, limit in SCENARIOS:
        for c in clients_list:
            s, p = find("oncepay", scenario, c), find("pgbench", limit, c)
            if not s:
                continue
            p = p or {}
            entry = {
                "scenario": scenario, "clients": c,
                "rps": s["rps"], "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"],
                "non_2xx": s.get("non_2xx", 0), "socket_errors": s.get("socket_errors", 0),
                "pgbench_rps": p.get("rps"), "pgbench_p50_ms": p.get("p50_ms"),
                "pgbench_p99_ms": p.get("p99_ms"),
                "ratio": ratio(s["rps"], p.get("rps", 0)),
            }
            if scenario == "replay":
                pk = find("pgbench", "pk", c)
                entry["pk_lookup_rps"] = pk["rps"] if pk else None
                entry["ratio_to_pk_lookup"] = ratio(s["rps"], pk["rps"]) if pk else None
            results.append(entry)
            lines.append(
                f"| {label} | {c} | {s['rps']:.0f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} "
                f"| {p.get('rps', 0):.0f} | {p.get('p50_ms', 0):.2f} | {p.get('p99_ms', 0):.2f} "
                f"| {entry['ratio'] if entry['ratio'] is not None else '-'} | {entry['non_2xx']} |")
    for c in clients_list:
        pk = find("pgbench", "pk", c)
        if pk:
            lines.append(f"| pk lookup (pgbench only) | {c} | | | | {pk['rps']:.0f} | {pk['p50_ms']:.2f} "
                         f"| {pk['p99_ms']:.2f} | | |")

    # The performance targets, where the figures exist.
    targets = []

    def target(name, value, goal, met):
        targets.append({"target": name, "value": value, "goal": goal, "met": met})

    new32 = next((r for r in results if r["scenario"] == "new" and r["clients"] == 32), None)
    rep32 = next((r for r in results if r["scenario"] == "replay" and r["clients"] == 32), None)
    if new32 and new32["ratio"] is not None:
        target("new charges at 32 clients / pgbench same SQL", new32["ratio"], ">= 0.75",
               new32["ratio"] >= 0.75)
        p99r = ratio(new32["p99_ms"], new32["pgbench_p99_ms"])
        target("new charges p99 at 32 clients / pgbench p99", p99r, "<= 2.0", p99r is not None and p99r <= 2.0)
    if rep32 and rep32.get("ratio_to_pk_lookup") is not None:
        target("replays at 32 clients / pgbench pk lookup", rep32["ratio_to_pk_lookup"], ">= 1.0",
               rep32["ratio_to_pk_lookup"] >= 1.0)
    for e in extras:
        if e["name"] == "big_table":
            r = ratio(e["rps"], e["baseline_rps"])
            target(f"new charges with {e['rows']} keys / empty table (32 clients)", r, ">= 0.90", r >= 0.90)
        if e["name"] == "sweeper":
            r = ratio(e["p99_ms"], e["baseline_p99_ms"])
            target(f"new-charge p99 while the sweeper deletes expired keys / baseline", r, "<= 2.0", r <= 2.0)
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
        "pool_size": meta.get("pool_size"),
        "pool_trials": meta.get("pool_trials", []),
        "seconds_per_run": meta.get("seconds"),
        "results": results,
        "raw": runs,
        "extras": extras,
        "targets": targets,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(summary, f, indent=2)

    text = [f"oncepay benchmark, {date}; {summary['machine']}; Postgres {summary['postgres']}; "
            f"pool {summary['pool_size']}; {summary['seconds_per_run']} s per run",
            "ratio = oncepay req/s / pgbench tx/s of the same SQL; latencies in milliseconds", ""]
    text += lines
    if summary["pool_trials"]:
        text += ["", "pool size trials (new charges, 32 clients): " + ", ".join(
            f"{t['pool']}: {t['rps']:.0f} req/s" for t in summary["pool_trials"])]
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
    output = "\n".join(text)
    print(output)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(output + "\n")

    # Chart data: one block per series, for gnuplot's `index`.
    series = [("oncepay", "new"), ("pgbench", "new"), ("oncepay", "replay"), ("pgbench", "replay"),
              ("pgbench", "pk"), ("oncepay", "storm"), ("pgbench", "storm")]
    with open(os.path.join(out_dir, "chart.dat"), "w") as f:
        for side, scenario in series:
            f.write(f"# {side} {scenario}\n")
            for c in clients_list:
                r = find(side, scenario, c)
                f.write(f"{c} {r['rps'] if r else 'NaN'}\n")
            f.write("\n\n")
    chart = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chart.gp")
    png = os.path.join(out_dir, "throughput.png")
    try:
        subprocess.run(["gnuplot", "-e", f"data='{out_dir}/chart.dat'; out='{png}'; "
                        f"subtitle='{date}, {os.cpu_count()} cores, pool {summary['pool_size']}'", chart],
                       check=True)
        print(f"\nchart: {png}")
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"\nno chart: gnuplot failed ({e})", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "pgbench":
        pgbench(*sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
