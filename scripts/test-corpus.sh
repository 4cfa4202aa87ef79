#!/usr/bin/env bash
# make test-corpus: PostgreSQL's own regression suite as a corpus of tables
# and types (e2e TestRegressionCorpus). The suite comes from Debian's source
# package of the installed postgresql-15 (its orig tarball, fetched once
# into EPITAPH_CORPUS_CACHE); pg_regress is Debian's.
set -euo pipefail

GO=${GO:-go}
CACHE=${EPITAPH_CORPUS_CACHE:-/var/cache/epitaph-corpus}
PG_REGRESS=${EPITAPH_PG_REGRESS:-/usr/lib/postgresql/15/lib/pgxs/src/test/regress/pg_regress}

version=$(dpkg-query -W -f='${Version}' postgresql-15 2>/dev/null || true)
if [ -z "$version" ]; then
	echo "test-corpus: Debian's postgresql-15 is not installed" >&2
	exit 2
fi
upstream=${version%%-*} # 15.18-0+deb12u1 -> 15.18
tarball="postgresql-15_${upstream}.orig.tar.bz2"
regress="$CACHE/postgresql-${upstream}/src/test/regress"

if [ ! -f "$regress/parallel_schedule" ]; then
	mkdir -p "$CACHE"
	if [ ! -s "$CACHE/$tarball" ]; then
		ok=
		for pool in http://deb.debian.org/debian/pool/main/p/postgresql-15 \
			http://deb.debian.org/debian-security/pool/updates/main/p/postgresql-15; do
			if curl -fsSL -o "$CACHE/$tarball.part" "$pool/$tarball"; then
				mv "$CACHE/$tarball.part" "$CACHE/$tarball"
				ok=1
				break
			fi
		done
		if [ -z "$ok" ]; then
			rm -f "$CACHE/$tarball.part"
			echo "test-corpus: cannot fetch $tarball from the Debian mirrors" >&2
			exit 2
		fi
	fi
	tar -xjf "$CACHE/$tarball" -C "$CACHE" "postgresql-${upstream}/src/test/regress"
fi
if [ ! -x "$PG_REGRESS" ]; then
	echo "test-corpus: no pg_regress at $PG_REGRESS (EPITAPH_PG_REGRESS)" >&2
	exit 2
fi

EPITAPH_CORPUS_REGRESS="$regress" EPITAPH_PG_REGRESS="$PG_REGRESS" \
	"$GO" test ./e2e -run '^TestRegressionCorpus$' -count=1 -v -timeout 90m
