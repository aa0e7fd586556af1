#!/bin/sh
# Entry point of the local postgres stand-in (bases.Dockerfile): on first start create the cluster
# in $PGDATA with the user, password and database of POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB,
# as the official image does; then run the server. PGPORT chooses the port (default 5432),
# POSTGRES_LISTEN the addresses (default *: all of the container's).
set -eu
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user="${POSTGRES_USER:-postgres}"
db="${POSTGRES_DB:-$user}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" -A scram-sha-256 --auth-local=trust -E UTF8 >/dev/null
  rm -f "$pwfile"
  printf '%s\n' "host all all 0.0.0.0/0 scram-sha-256" "host all all ::/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -p ${PGPORT:-5432}" -w start >/dev/null
  if [ "$db" != "postgres" ]; then
    createdb -p "${PGPORT:-5432}" -U "$user" "$db"
  fi
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  echo "postgres-entrypoint: cluster created in $PGDATA (user $user, database $db)"
fi
if [ "${1:-postgres}" = "postgres" ]; then
  [ "$#" -gt 0 ] && shift
  exec postgres -D "$PGDATA" -p "${PGPORT:-5432}" -c "listen_addresses=${POSTGRES_LISTEN:-*}" "$@"
fi
exec "$@"
