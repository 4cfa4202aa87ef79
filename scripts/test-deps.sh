#!/usr/bin/env bash
# Installs the Debian packages that some tests drive as real programs, when
# they are missing: promtool and prometheus (alert rule tests, a real
# Prometheus scraping the real processes), chromium (the status page in a
# real headless browser), docker-compose (schema validation of
# deploy/compose.yaml) and systemd (systemd-analyze verify of the units in
# deploy/systemd/). PostgreSQL's server packages are a prerequisite, not
# installed here. Nothing is installed when everything is present.
set -euo pipefail

need=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
[ ${#need[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: missing ${need[*]}: install them with your package manager (Debian: apt-get install ${need[*]})" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "test-deps: run as root or install: apt-get install -y ${need[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "test-deps: installing ${need[*]} (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
