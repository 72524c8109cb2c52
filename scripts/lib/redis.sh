#!/usr/bin/env bash
# scripts/lib/redis.sh - find or start a Redis for the workshop's Redis
# variant of the key store (POST /demo/redis/charges). Nothing else in
# oncepay uses Redis.
#
# Sourced by scripts/demo and scripts/test (not run directly), after
# scripts/lib/common.sh. Provides:
#
#   oncepay_redis_ensure    exports REDIS_URL pointing at a Redis that answers:
#                             1. $REDIS_URL, if set and it answers;
#                             2. redis://127.0.0.1:6379, if a Redis answers there;
#                             3. a private redis-server under <project>/.redis on
#                                a free port (Debian's redis-server package is
#                                installed if missing), without persistence.
#                           Returns 1, saying why, when none can be had.
#   oncepay_redis_stop      stops the private one, only if this shell started it
#                           (ONCEPAY_REDIS_STARTED=1). Call it from an EXIT trap.
#
# Settings (environment):
#   ONCEPAY_REDIS_DIR          private server folder (default <project>/.redis)
#   ONCEPAY_REDIS_PORT_START   first port probed for it (63790)

if [[ -n "${_ONCEPAY_REDIS_LIB:-}" ]]; then
    return 0
fi
_ONCEPAY_REDIS_LIB=1

ONCEPAY_ROOT="${ONCEPAY_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
ONCEPAY_REDIS_STARTED=0
_oncepay_redis_pid=""

# True if something at HOST:PORT answers PING as Redis does: +PONG, or an
# error asking for a password (the URL may carry it). Bash's /dev/tcp, so
# that no client is needed to look.
_oncepay_redis_answers() {
    local host="$1" port="$2" reply
    # shellcheck disable=SC2016 # $1/$2 expand in the inner bash
    reply="$(timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2" && printf "PING\r\n" >&3 &&
        IFS= read -r -t 2 line <&3 && printf "%s\n" "$line"' _ "$host" "$port" 2>/dev/null)" || true
    [[ "$reply" == +PONG* || "$reply" == -NOAUTH* || "$reply" == -WRONGPASS* ]]
}

# Prints "HOST PORT" of a redis:// URL (defaults 127.0.0.1 and 6379).
_oncepay_redis_host_port() {
    local rest="${1#redis://}" host port
    rest="${rest%%/*}"
    rest="${rest##*@}"
    if [[ "$rest" =~ ^\[([^]]+)\](:([0-9]+))?$ ]]; then
        host="${BASH_REMATCH[1]}" port="${BASH_REMATCH[3]}"
    else
        host="${rest%%:*}"
        [[ "$rest" == *:* ]] && port="${rest##*:}"
    fi
    echo "${host:-127.0.0.1} ${port:-6379}"
}

_oncepay_redis_free_port() {
    local port
    for ((port = ${ONCEPAY_REDIS_PORT_START:-63790}; port < ${ONCEPAY_REDIS_PORT_START:-63790} + 200; port++)); do
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return 0
        fi
    done
    say "no free port for Redis from ${ONCEPAY_REDIS_PORT_START:-63790} upward"
    return 1
}

oncepay_redis_ensure() {
    local host port
    if [[ -n "${REDIS_URL:-}" ]]; then
        [[ "$REDIS_URL" == redis://* ]] || {
            say "REDIS_URL=$REDIS_URL is not a redis:// URL"
            return 1
        }
        read -r host port <<<"$(_oncepay_redis_host_port "$REDIS_URL")"
        if _oncepay_redis_answers "$host" "$port"; then
            say "using the Redis at REDIS_URL ($host:$port)"
            export REDIS_URL
            return 0
        fi
        say "REDIS_URL is set but nothing answers at $host:$port"
        return 1
    fi
    if _oncepay_redis_answers 127.0.0.1 6379; then
        say "using the Redis at 127.0.0.1:6379"
        export REDIS_URL=redis://127.0.0.1:6379
        return 0
    fi

    # A private one, on a free port, gone when this shell ends.
    if ! command -v redis-server >/dev/null 2>&1; then
        oncepay_apt_install redis-server || {
            say "no Redis answers and redis-server could not be installed"
            return 1
        }
        hash -r
        # Debian's package starts a service of its own where it can; use it.
        if _oncepay_redis_answers 127.0.0.1 6379; then
            say "using the Redis the redis-server package started, at 127.0.0.1:6379"
            export REDIS_URL=redis://127.0.0.1:6379
            return 0
        fi
    fi
    local dir="${ONCEPAY_REDIS_DIR:-$ONCEPAY_ROOT/.redis}" attempt log waited
    mkdir -p "$dir"
    # The port is free when probed, but another process may bind it before
    # Redis does: then Redis exits saying so, and another port is tried.
    # Ready means this very process logged it is ready (not some other
    # Redis answering on the port), within a budget a loaded machine keeps.
    for attempt in 1 2 3 4 5; do
        port="$(_oncepay_redis_free_port)" || return 1
        log="$dir/redis-$port-$$.log"
        say "starting a private Redis on 127.0.0.1:$port (log: $log)"
        redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" \
            --save '' --appendonly no --daemonize no \
            --logfile "$log" >/dev/null 2>&1 &
        _oncepay_redis_pid=$!
        ONCEPAY_REDIS_STARTED=1
        for ((waited = 0; waited < 300; waited++)); do
            if grep -q "Ready to accept connections" "$log" 2>/dev/null &&
                kill -0 "$_oncepay_redis_pid" 2>/dev/null &&
                _oncepay_redis_answers 127.0.0.1 "$port"; then
                export REDIS_URL="redis://127.0.0.1:$port"
                return 0
            fi
            kill -0 "$_oncepay_redis_pid" 2>/dev/null || break
            sleep 0.1
        done
        oncepay_redis_stop
        if ! grep -q "Address already in use" "$log" 2>/dev/null; then
            break
        fi
        say "port $port was taken before Redis bound it (attempt $attempt); another port"
    done
    say "the private Redis did not start; see $log"
    return 1
}

oncepay_redis_stop() {
    if [[ "$ONCEPAY_REDIS_STARTED" == 1 && -n "$_oncepay_redis_pid" ]]; then
        if kill -0 "$_oncepay_redis_pid" 2>/dev/null; then
            say "stopping the private Redis (pid $_oncepay_redis_pid)"
            kill -TERM "$_oncepay_redis_pid" 2>/dev/null || true
            wait "$_oncepay_redis_pid" 2>/dev/null || true
        fi
        ONCEPAY_REDIS_STARTED=0
        _oncepay_redis_pid=""
    fi
}
