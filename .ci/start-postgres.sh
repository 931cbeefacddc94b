#!/usr/bin/env bash
# Start a throwaway PostgreSQL on loopback for the DB tests and print the URL to use:
#
#   eval "$(.ci/start-postgres.sh)"      # sets MLA_TUNE_TEST_PG_URL
#
# Installs Debian's postgresql when no server is found. Progress goes to stderr; stdout
# carries only the export line. Safe to re-run: an existing cluster is reused.
# Settings: MLA_TUNE_PG_DIR (data directory, default /tmp/mla-tune-pg),
#           MLA_TUNE_PG_PORT (default 54329, away from a system server on 5432).
set -euo pipefail

PG_DIR="$(realpath -m "${MLA_TUNE_PG_DIR:-/tmp/mla-tune-pg}")"
PG_PORT="${MLA_TUNE_PG_PORT:-54329}"
NAME=mlatune        # role and database
PASSWORD=mlatune    # loopback-only test server

log() { echo "start-postgres: $*" >&2; }

# Server binaries: pg_config's bindir, else Debian's versioned directory, else PATH.
find_bindir() {
    local d
    if command -v pg_config >/dev/null 2>&1; then
        d="$(pg_config --bindir)"
        [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && { echo "$d"; return 0; }
    fi
    d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
    [ -n "$d" ] && [ -x "$d/initdb" ] && { echo "$d"; return 0; }
    d="$(command -v initdb 2>/dev/null)" || return 1
    dirname "$(readlink -f "$d")"
}

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
    # The server refuses to run as root; run it as the postgres user the package creates.
    AS_PG=(runuser -u postgres --)
else
    SUDO=(sudo)
    AS_PG=()
fi
as_pg() { "${AS_PG[@]}" "$@"; }

if ! BINDIR="$(find_bindir)"; then
    log "no PostgreSQL server found; installing Debian's postgresql"
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -qq >&2
    "${SUDO[@]}" apt-get install -y -qq postgresql >&2
    BINDIR="$(find_bindir)"
fi
log "using $BINDIR"

cd /  # the postgres user may not be allowed into the caller's directory

if [ ! -s "$PG_DIR/PG_VERSION" ]; then
    log "initializing $PG_DIR"
    mkdir -p "$PG_DIR"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$PG_DIR"
    chmod 700 "$PG_DIR"
    # Local socket connections (in the 0700 data dir) are trusted; TCP needs a password.
    as_pg "$BINDIR/initdb" -D "$PG_DIR" -U postgres -E UTF8 --locale=C \
        --auth-local=trust --auth-host=scram-sha-256 >&2
fi

if as_pg "$BINDIR/pg_ctl" -D "$PG_DIR" status >/dev/null 2>&1; then
    log "server already running in $PG_DIR"
else
    log "starting server on 127.0.0.1:$PG_PORT"
    as_pg "$BINDIR/pg_ctl" -D "$PG_DIR" -l "$PG_DIR/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -c port=$PG_PORT -c unix_socket_directories=$PG_DIR" \
        start >&2 || { tail -n 20 "$PG_DIR/server.log" >&2; exit 1; }
fi

psql_admin() {
    as_pg "$BINDIR/psql" -h "$PG_DIR" -p "$PG_PORT" -U postgres -d postgres \
        -v ON_ERROR_STOP=1 -qtA "$@"
}
if [ "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = '$NAME'")" != 1 ]; then
    psql_admin -c "CREATE ROLE $NAME LOGIN PASSWORD '$PASSWORD'"
fi
if [ "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = '$NAME'")" != 1 ]; then
    psql_admin -c "CREATE DATABASE $NAME OWNER $NAME"
fi

log "ready; stop with: ${AS_PG[*]} $BINDIR/pg_ctl -D $PG_DIR stop"
echo "export MLA_TUNE_TEST_PG_URL=postgresql+psycopg://$NAME:$PASSWORD@127.0.0.1:$PG_PORT/$NAME"
