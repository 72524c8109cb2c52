#!/usr/bin/env bash
# scripts/lib/postgres.sh - find or start a PostgreSQL server for oncepay.
#
# Sourced by scripts/run and scripts/test (not run directly). Provides:
#
#   oncepay_pg_ensure DBNAME  exports DATABASE_URL pointing at a reachable
#                             server and an existing database, choosing:
#                               1. $DATABASE_URL, if set and reachable (used as is);
#                               2. postgres://postgres@127.0.0.1:5432/DBNAME, if
#                                  that server answers (DBNAME created if missing);
#                               3. a private cluster in <project>/.pgdata on a free
#                                  port (initdb'd / started as needed; Debian's
#                                  postgresql package is installed if no initdb).
#   oncepay_pg_stop           stops the private cluster, only if this shell
#                             started it (ONCEPAY_PG_STARTED=1). Call it from an
#                             EXIT trap.
#
# Settings (environment):
#   ONCEPAY_PG_PRIVATE=1   skip 1 and 2, always use the private cluster
#   ONCEPAY_PG_DIR         private cluster folder (default <project>/.pgdata)
#   ONCEPAY_PG_PORT_START  first port probed for the private cluster (54320)
#   PGCONNECT_TIMEOUT      connect timeout in seconds for the probes (3)
#
# Messages go to stderr, prefixed with the calling script's name.

# Guard against being sourced twice.
if [[ -n "${_ONCEPAY_PG_LIB:-}" ]]; then
    return 0
fi
_ONCEPAY_PG_LIB=1

ONCEPAY_ROOT="${ONCEPAY_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
ONCEPAY_PG_STARTED=0 # 1 once this shell has started the private cluster
_oncepay_pg_me="$(basename "${0:-oncepay}")"

_oncepay_pg_say() { printf '%s: %s\n' "$_oncepay_pg_me" "$*" >&2; }
_oncepay_pg_die() {
    _oncepay_pg_say "error: $*"
    return 1
}

# Prints URL with any password replaced by ***.
oncepay_pg_redact() {
    # shellcheck disable=SC2001
    sed -e 's#^\([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*\):[^@/]*@#\1:***@#' <<<"$1"
}

# psql that never prompts for a password and ignores ~/.psqlrc.
_oncepay_psql() {
    PGCONNECT_TIMEOUT="${PGCONNECT_TIMEOUT:-3}" psql -X -w "$@"
}

# True if URL accepts a connection and answers `select 1`.
_oncepay_pg_reachable() {
    [[ "$(_oncepay_psql "$1" -Atqc 'select 1' 2>/dev/null)" == 1 ]]
}

# Runs a command as the user that owns the private cluster: `postgres` when we
# are root (PostgreSQL refuses to run as root), ourselves otherwise. Runs from /
# so the postgres user never trips over an unreadable current directory.
_oncepay_pg_as_owner() {
    if [[ "$(id -u)" -eq 0 ]]; then
        (cd / && runuser -u postgres -- "$@")
    else
        (cd / && "$@")
    fi
}

# Installs Debian packages, with sudo when not root (scripts/lib/common.sh's
# installer when the calling script has it).
_oncepay_pg_apt_install() {
    if declare -F oncepay_apt_install >/dev/null; then
        oncepay_apt_install "$@"
        return
    fi
    local sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1; then
            sudo=(sudo)
        else
            _oncepay_pg_die "need to install $* but not root and no sudo; install it yourself" || return 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        _oncepay_pg_die "need $* but apt-get is not available; install PostgreSQL yourself" || return 1
    fi
    _oncepay_pg_say "installing $* with apt-get (this takes a minute)"
    "${sudo[@]}" apt-get update -qq >&2 &&
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

_oncepay_pg_need_psql() {
    command -v psql >/dev/null 2>&1 && return 0
    _oncepay_pg_apt_install postgresql-client || return 1
    hash -r
    command -v psql >/dev/null 2>&1 || _oncepay_pg_die "psql still not found after installing postgresql-client"
}

# Sets _ONCEPAY_PG_BINDIR to a directory with initdb and pg_ctl, or fails.
# PREFERRED (a major version) is tried first, then PATH, then
# /usr/lib/postgresql/*/bin, newest first.
_oncepay_pg_find_bindir() {
    local preferred="${1:-}" dir candidates=() initdb
    if [[ -n "$preferred" ]]; then
        candidates+=("/usr/lib/postgresql/$preferred/bin")
    fi
    if initdb="$(command -v initdb 2>/dev/null)" && command -v pg_ctl >/dev/null 2>&1; then
        candidates+=("$(dirname "$initdb")")
    fi
    while IFS= read -r dir; do
        candidates+=("$dir")
    done < <(compgen -G '/usr/lib/postgresql/*/bin' | sort -t/ -k4,4 -V -r)
    for dir in "${candidates[@]}"; do
        if [[ -x "$dir/initdb" && -x "$dir/pg_ctl" ]]; then
            _ONCEPAY_PG_BINDIR="$dir"
            return 0
        fi
    done
    return 1
}

# Makes sure initdb and pg_ctl exist (and, as root, the postgres user), for
# tests that start and stop a cluster of their own; installs Debian's
# postgresql package otherwise.
oncepay_pg_ensure_binaries() {
    if _oncepay_pg_find_bindir "" && { [[ "$(id -u)" -ne 0 ]] || id postgres >/dev/null 2>&1; }; then
        return 0
    fi
    _oncepay_pg_apt_install postgresql || return 1
    hash -r
    _oncepay_pg_find_bindir "" || _oncepay_pg_die "initdb/pg_ctl still not found after installing postgresql"
}

# True if nothing listens on 127.0.0.1:PORT and it can be bound.
_oncepay_pg_port_free() {
    local port="$1"
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$port" <<'PY' 2>/dev/null
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
PY
        return
    fi
    # Fallback: free if nobody accepts a connection there.
    ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
}

# Prints a free port: PREFERRED if free, else the first free from
# ONCEPAY_PG_PORT_START (54320) upward.
_oncepay_pg_free_port() {
    local preferred="${1:-}" port
    if [[ "$preferred" =~ ^[0-9]+$ ]] && _oncepay_pg_port_free "$preferred"; then
        echo "$preferred"
        return 0
    fi
    for ((port = ${ONCEPAY_PG_PORT_START:-54320}; port < ${ONCEPAY_PG_PORT_START:-54320} + 200; port++)); do
        if _oncepay_pg_port_free "$port"; then
            echo "$port"
            return 0
        fi
    done
    _oncepay_pg_die "no free port found from ${ONCEPAY_PG_PORT_START:-54320} upward"
}

# Makes every directory from / down to DIR traversable by the postgres user
# (root only), adding o+x where needed.
_oncepay_pg_make_traversable() {
    local dir="$1" path=""
    runuser -u postgres -- test -x "$dir" 2>/dev/null && return 0
    local part parts
    IFS=/ read -r -a parts <<<"${dir#/}"
    for part in "${parts[@]}"; do
        path="$path/$part"
        if ! runuser -u postgres -- test -x "$path" 2>/dev/null; then
            _oncepay_pg_say "making $path traversable (o+x) so the postgres user can reach $dir"
            chmod o+x "$path"
        fi
    done
}

# Creates database DB at server URL (any database of that server) unless it
# exists; tolerates a concurrent creation.
_oncepay_pg_createdb() {
    local url="$1" db="$2" exists
    exists="$(_oncepay_psql "$url" -Atqc "select 1 from pg_database where datname = '$db'")" || return 1
    [[ "$exists" == 1 ]] && return 0
    _oncepay_pg_say "creating database $db"
    if ! _oncepay_psql "$url" -qc "create database \"$db\"" >/dev/null 2>&1; then
        # Maybe another run created it meanwhile.
        exists="$(_oncepay_psql "$url" -Atqc "select 1 from pg_database where datname = '$db'")" || return 1
        [[ "$exists" == 1 ]] || _oncepay_pg_die "could not create database $db"
    fi
}

# Reads the port of a running cluster from its postmaster.pid (line 4).
_oncepay_pg_running_port() {
    sed -n 4p "$1/postmaster.pid" 2>/dev/null
}

# Step 3: the private cluster. Sets _ONCEPAY_PG_PRIVATE_PORT.
_oncepay_pg_private() {
    local pgdir="${ONCEPAY_PG_DIR:-$ONCEPAY_ROOT/.pgdata}"
    local data version="" sockdir port="" last_port="" attempt need_install=0 lockfd=""

    [[ -f "$pgdir/data/PG_VERSION" ]] && version="$(<"$pgdir/data/PG_VERSION")"
    _oncepay_pg_find_bindir "$version" || need_install=1
    if [[ "$(id -u)" -eq 0 ]] && ! id postgres >/dev/null 2>&1; then
        need_install=1 # the package creates the postgres user too
    fi
    if ((need_install)); then
        _oncepay_pg_say "no initdb/pg_ctl found (PATH, /usr/lib/postgresql/*/bin) or no postgres user"
        _oncepay_pg_apt_install postgresql || return 1
        hash -r
        _oncepay_pg_find_bindir "$version" ||
            _oncepay_pg_die "initdb/pg_ctl still not found after installing postgresql" || return 1
    fi
    local bin="$_ONCEPAY_PG_BINDIR"

    mkdir -p "$pgdir"
    pgdir="$(cd "$pgdir" && pwd)"
    data="$pgdir/data"
    local log="$pgdir/postgres.log"
    if [[ "$(id -u)" -eq 0 ]]; then
        chown -R postgres:postgres "$pgdir"
        _oncepay_pg_make_traversable "$pgdir"
    fi
    chmod 700 "$pgdir"

    # One run at a time from here on (concurrent runs of the scripts).
    if command -v flock >/dev/null 2>&1; then
        exec {lockfd}>>"$pgdir/.lock"
        flock -w 120 "$lockfd" || _oncepay_pg_say "warning: could not lock $pgdir/.lock; going on"
    fi

    if [[ -d "$data" && ! -f "$data/PG_VERSION" ]]; then
        _oncepay_pg_say "removing the half-initialised $data"
        rm -rf "$data"
    fi
    if [[ ! -f "$data/PG_VERSION" ]]; then
        _oncepay_pg_say "initialising a private cluster in $data ($bin/initdb)"
        if ! _oncepay_pg_as_owner "$bin/initdb" -D "$data" --auth=trust -U postgres \
            --encoding=UTF8 --locale=C >"$pgdir/initdb.log" 2>&1; then
            _oncepay_pg_say "initdb failed; see $pgdir/initdb.log:"
            tail -n 20 "$pgdir/initdb.log" >&2
            [[ -n "$lockfd" ]] && exec {lockfd}>&-
            return 1
        fi
        echo "include_if_exists = 'oncepay.conf'" >>"$data/postgresql.conf"
    fi

    if _oncepay_pg_as_owner "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        port="$(_oncepay_pg_running_port "$data")"
        _oncepay_pg_say "reusing the private cluster already running in $data (port $port)"
    else
        # The Unix socket goes inside .pgdata unless that path is too long for a
        # socket (107 bytes), then into a private /tmp folder.
        sockdir="$pgdir/run"
        if ((${#sockdir} > 80)); then
            sockdir="/tmp/oncepay-pg-$(id -u)-$(printf '%s' "$pgdir" | cksum | cut -d' ' -f1)"
        fi
        mkdir -p "$sockdir"
        if [[ "$(id -u)" -eq 0 ]]; then chown postgres:postgres "$sockdir"; fi
        chmod 700 "$sockdir"
        [[ -f "$pgdir/port" ]] && last_port="$(<"$pgdir/port")"
        for attempt in 1 2 3; do
            port="$(_oncepay_pg_free_port "$last_port")" || break
            cat >"$data/oncepay.conf" <<EOF
# Written by scripts/lib/postgres.sh at each start; edits are overwritten.
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '${sockdir//\'/\'\'}'
EOF
            if [[ "$(id -u)" -eq 0 ]]; then chown postgres:postgres "$data/oncepay.conf"; fi
            _oncepay_pg_say "starting the private cluster in $data on 127.0.0.1:$port (log: $log)"
            # The server must not inherit the lock's descriptor (it would hold
            # the lock for as long as it runs).
            if _oncepay_pg_as_owner "$bin/pg_ctl" -D "$data" -l "$log" -w -t 60 start \
                >/dev/null {lockfd}>&-; then
                ONCEPAY_PG_STARTED=1
                echo "$port" >"$pgdir/port"
                break
            fi
            _oncepay_pg_say "pg_ctl start failed (attempt $attempt); last log lines:"
            tail -n 5 "$log" >&2 || true
            last_port="" port=""
        done
    fi
    [[ -n "$lockfd" ]] && exec {lockfd}>&-
    if [[ -z "$port" ]]; then
        _oncepay_pg_die "could not start the private cluster in $data; see $log"
        return 1
    fi
    _ONCEPAY_PG_DATA="$data"
    _ONCEPAY_PG_BIN="$bin"
    _ONCEPAY_PG_PRIVATE_PORT="$port"
}

# oncepay_pg_ensure DBNAME: see the header.
oncepay_pg_ensure() {
    local db="${1:?usage: oncepay_pg_ensure DBNAME}" url
    if [[ ! "$db" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
        _oncepay_pg_die "bad database name '$db' (letters, digits and _ only)"
        return 1
    fi
    _oncepay_pg_need_psql || return 1

    if [[ "${ONCEPAY_PG_PRIVATE:-0}" != 1 ]]; then
        # 1. DATABASE_URL as given.
        if [[ -n "${DATABASE_URL:-}" ]]; then
            if _oncepay_pg_reachable "$DATABASE_URL"; then
                export DATABASE_URL
                _oncepay_pg_say "using Postgres from DATABASE_URL: $(oncepay_pg_redact "$DATABASE_URL")"
                return 0
            fi
            # The server answers but the database is not there yet: make it.
            local base="${DATABASE_URL%%\?*}"
            local query="${DATABASE_URL#"$base"}" name="${base##*/}"
            if [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] &&
                _oncepay_pg_reachable "${base%/*}/postgres$query"; then
                _oncepay_pg_createdb "${base%/*}/postgres$query" "$name" || return 1
                export DATABASE_URL
                _oncepay_pg_say "using Postgres from DATABASE_URL: $(oncepay_pg_redact "$DATABASE_URL")"
                return 0
            fi
            _oncepay_pg_say "DATABASE_URL $(oncepay_pg_redact "$DATABASE_URL") is not reachable; looking further"
        fi
        # 2. The usual local server.
        url="postgres://postgres@127.0.0.1:5432"
        if _oncepay_pg_reachable "$url/postgres"; then
            _oncepay_pg_createdb "$url/postgres" "$db" || return 1
            export DATABASE_URL="$url/$db"
            _oncepay_pg_say "using the local Postgres server: $DATABASE_URL"
            return 0
        fi
    fi

    # 3. The private cluster.
    _oncepay_pg_private || return 1
    url="postgres://postgres@127.0.0.1:$_ONCEPAY_PG_PRIVATE_PORT"
    if ! _oncepay_pg_reachable "$url/postgres"; then
        _oncepay_pg_die "the private cluster does not answer at $url"
        return 1
    fi
    _oncepay_pg_createdb "$url/postgres" "$db" || return 1
    export DATABASE_URL="$url/$db"
    _oncepay_pg_say "using the private Postgres cluster in $(dirname "$_ONCEPAY_PG_DATA"): $DATABASE_URL"
}

# Stops the private cluster if (and only if) this shell started it.
oncepay_pg_stop() {
    if [[ "${ONCEPAY_PG_STARTED:-0}" == 1 && -n "${_ONCEPAY_PG_DATA:-}" ]]; then
        _oncepay_pg_say "stopping the private Postgres cluster"
        _oncepay_pg_as_owner "$_ONCEPAY_PG_BIN/pg_ctl" -D "$_ONCEPAY_PG_DATA" -m fast -w stop >/dev/null ||
            _oncepay_pg_say "warning: could not stop the cluster in $_ONCEPAY_PG_DATA"
        ONCEPAY_PG_STARTED=0
    fi
    return 0
}
