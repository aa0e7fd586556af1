#!/usr/bin/env bash
# Makes sure Postgres (127.0.0.1:5432) and Redis (127.0.0.1:6379) are up for the service tests:
# installs them from Debian's packages when missing, starts them when down.
set -euo pipefail
need_apt=()
command -v pg_ctlcluster >/dev/null 2>&1 || need_apt+=(postgresql)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[services] installing ${need_apt[*]}" >&2
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >&2
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  echo "[services] starting Postgres" >&2
  ver=$(ls /etc/postgresql | sort -V | tail -n 1)
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start >&2 || true
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
pg_isready -q -h 127.0.0.1 -p 5432 || { echo "[services] Postgres is not reachable on 127.0.0.1:5432" >&2; exit 1; }
# trust auth for local TCP connections as user postgres is what the tests expect
if ! psql -h 127.0.0.1 -U postgres -d postgres -Atc 'select 1' >/dev/null 2>&1; then
  echo "[services] cannot connect as postgres over TCP without a password; configure trust auth for 127.0.0.1" >&2
  exit 1
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "[services] starting Redis" >&2
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log >&2
  for _ in $(seq 1 20); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.5; done
fi
redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null || { echo "[services] Redis is not reachable" >&2; exit 1; }
