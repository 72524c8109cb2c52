#!/usr/bin/env bash
# scripts/lib/nats.sh - find or start a NATS server with JetStream, the
# broker the relay publishes events to and the ledger consumer reads.
#
# Sourced by scripts/test (not run directly), after scripts/lib/common.sh.
# Provides:
#
#   oncepay_nats_ensure    exports NATS_URL pointing at a NATS server with
#                          JetStream that answers:
#                            1. $NATS_URL (its first address), if set and it answers;
#                            2. nats://127.0.0.1:4222, if one answers there;
#                            3. a private nats-server under <project>/.nats on a
#                               port the server picks itself (Debian's
#                               nats-server package is installed if missing).
#                          Returns 1, saying why, when none can be had.
#   oncepay_nats_stop      stops the private one, only if this shell started it.
#                          Call it from an EXIT trap.
#
# Settings (environment):
#   ONCEPAY_NATS_DIR       private server folder (default <project>/.nats)

if [[ -n "${_ONCEPAY_NATS_LIB:-}" ]]; then
    return 0
fi
_ONCEPAY_NATS_LIB=1

ONCEPAY_ROOT="${ONCEPAY_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
_oncepay_nats_pid=""

# True if a NATS server with JetStream answers at HOST:PORT: its greeting,
# INFO {...}, says "jetstream":true. Bash's /dev/tcp, so that no client is
# needed to look.
_oncepay_nats_answers() {
    local host="$1" port="$2" greeting
    # shellcheck disable=SC2016 # $1/$2 expand in the inner bash
    greeting="$(timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2" &&
        IFS= read -r -t 2 line <&3 && printf "%s\n" "$line"' _ "$host" "$port" 2>/dev/null)" || true
    [[ "$greeting" == INFO* && "$greeting" == *'"jetstream":true'* ]]
}

# Prints "HOST PORT" of the first address of a NATS URL list.
_oncepay_nats_host_port() {
    local rest="${1%%,*}" host port
    rest="${rest#*://}"
    rest="${rest##*@}"
    host="${rest%%:*}"
    [[ "$rest" == *:* ]] && port="${rest##*:}"
    echo "${host:-127.0.0.1} ${port:-4222}"
}

oncepay_nats_ensure() {
    local host port
    if [[ -n "${NATS_URL:-}" ]]; then
        read -r host port <<<"$(_oncepay_nats_host_port "$NATS_URL")"
        if _oncepay_nats_answers "$host" "$port"; then
            say "using the NATS server at NATS_URL ($host:$port)"
            export NATS_URL
            return 0
        fi
        say "NATS_URL is set but no NATS server with JetStream answers at $host:$port; looking further"
    fi
    if _oncepay_nats_answers 127.0.0.1 4222; then
        say "using the NATS server at 127.0.0.1:4222"
        export NATS_URL=nats://127.0.0.1:4222
        return 0
    fi
    if ! command -v nats-server >/dev/null 2>&1; then
        oncepay_apt_install nats-server || {
            say "no NATS server answers and nats-server could not be installed"
            return 1
        }
        hash -r
    fi
    # A private one on a port it picks itself (-p -1) and logs, so no port
    # is probed first and taken by someone else meanwhile; its JetStream
    # files in a folder of this run's own, removed when it stops.
    local dir="${ONCEPAY_NATS_DIR:-$ONCEPAY_ROOT/.nats}/run-$$" log waited
    mkdir -p "$dir"
    log="$dir/nats-server.log"
    say "starting a private NATS server with JetStream (log: $log)"
    nats-server -a 127.0.0.1 -p -1 -js -sd "$dir/store" -l "$log" >/dev/null 2>&1 &
    _oncepay_nats_pid=$!
    # Ready is this process logging it, however long a loaded machine takes.
    for ((waited = 0; ; waited++)); do
        kill -0 "$_oncepay_nats_pid" 2>/dev/null || break
        if grep -q "Server is ready" "$log" 2>/dev/null; then
            port="$(sed -n 's/.*Listening for client connections on 127\.0\.0\.1:\([0-9]*\).*/\1/p' "$log" | head -1)"
            if [[ -n "$port" ]] && _oncepay_nats_answers 127.0.0.1 "$port"; then
                export NATS_URL="nats://127.0.0.1:$port"
                say "the private NATS server listens on 127.0.0.1:$port"
                return 0
            fi
        fi
        ((waited % 100 == 99)) && say "still waiting for the private NATS server ($((waited / 10 + 1)) s)"
        sleep 0.1
    done
    say "the private NATS server exited; see $log"
    _oncepay_nats_pid=""
    return 1
}

oncepay_nats_stop() {
    if [[ -n "$_oncepay_nats_pid" ]]; then
        if kill -0 "$_oncepay_nats_pid" 2>/dev/null; then
            say "stopping the private NATS server (pid $_oncepay_nats_pid)"
            kill -TERM "$_oncepay_nats_pid" 2>/dev/null || true
            wait "$_oncepay_nats_pid" 2>/dev/null || true
        fi
        rm -rf "${ONCEPAY_NATS_DIR:-$ONCEPAY_ROOT/.nats}/run-$$"
        _oncepay_nats_pid=""
    fi
}
