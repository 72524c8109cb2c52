#!/usr/bin/env bash
# scripts/lib/common.sh - what every oncepay script shares. Sourced first:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
#
# Provides:
#   say MESSAGE...          a line on stderr, prefixed with the script's name
#   die MESSAGE...          say "error: ..." and exit 1
#   step MESSAGE...         a step heading on stderr
#   oncepay_apt_install PKG...
#                           installs Debian packages (sudo when not root);
#                           returns 1, saying why, when that is impossible
#   gateway_key BIN URL FILE NAME LOG
#                           prints a secret key of the card gateway at URL
#                           (for oncepay's PROCESSOR_API_KEY)
# and leaves the shell in the project root, exported as ONCEPAY_ROOT.

if [[ -n "${_ONCEPAY_COMMON_LIB:-}" ]]; then
    return 0
fi
_ONCEPAY_COMMON_LIB=1

me="$(basename "${0:-oncepay}")"

say() { printf '%s: %s\n' "$me" "$*" >&2; }

die() {
    say "error: $*"
    exit 1
}

# step WHAT: announces a step of a script, with the seconds since it began.
step() { printf '\n%s: ==> %s (at %ss)\n' "$me" "$*" "$SECONDS" >&2; }

# gateway_key BIN URL FILE NAME LOG: prints a secret key of the card gateway
# at URL, whose ledger is PROCESSOR_DATABASE_URL: the one kept in FILE while
# the gateway accepts it (so the account, and the payments made under it,
# carry over from one run to the next), else that of a new account named
# NAME and the time, made with BIN (`oncepay processor accounts create`,
# its log appended to LOG) and kept in FILE, readable by its owner only.
gateway_key() {
    local bin="$1" url="$2" file="$3" name="$4" log="$5" key status
    if [[ -s "$file" ]]; then
        key="$(<"$file")"
        status="$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $key" \
            "$url/v1/operations?limit=1" || true)"
        if [[ "$status" == 200 ]]; then
            printf '%s\n' "$key"
            return 0
        fi
    fi
    key="$("$bin" processor accounts create --name "$name $(date -u +%Y-%m-%dT%H:%M:%SZ) $$" 2>>"$log")" ||
        die "could not make an account at the card gateway (log: $log)"
    (
        umask 077
        printf '%s\n' "$key" >"$file"
    )
    printf '%s\n' "$key"
}

oncepay_apt_install() {
    local sudo=()
    if [[ "$(id -u)" -ne 0 ]]; then
        if ! command -v sudo >/dev/null 2>&1; then
            say "need to install $* but not root and no sudo; install it yourself"
            return 1
        fi
        sudo=(sudo)
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        say "need $* but apt-get is not available; install it yourself"
        return 1
    fi
    say "installing $* with apt-get"
    # Without a fresh package index the install may fail; try it as is first.
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2 && return 0
    "${sudo[@]}" apt-get update -qq >&2 &&
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
ONCEPAY_ROOT="$(pwd)"
export ONCEPAY_ROOT
