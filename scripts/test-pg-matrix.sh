#!/usr/bin/env bash
# The version matrix: on each PostgreSQL major of PG_MATRIX (default 14 16
# 17 18; Debian's 15 runs every test), the capture's value-type and
# replica-identity tests, the DDL guard's notify and prepared-transaction
# tests, and one exactly-once end-to-end run, through
# EPITAPH_TEST_PG. A major whose server binaries are absent (make test-deps
# installs them) is skipped with a message, except under CI, where it fails.
set -euo pipefail

GO="${GO:-go}"
versions="${PG_MATRIX:-14 16 17 18}"
# TestServerIsTheRequestedMajor proves each run is on the version it names.
run='^(TestServerIsTheRequestedMajor|TestLosslessValues|TestReplicaIdentity|TestKeys|TestMixedIdentityPartitions|TestPartitionedTableNamesParent|TestPublicationRowFilterAndColumnListAreRemoved|TestSlotWithoutFailoverBefore17|TestPartitionMoveNotADelete|TestGeneratedColumns|TestKeyRenamedBesideAStoredGeneratedColumn|TestLeafWithAnotherReplicaIdentityIndexIsNeverLabelledWhole|TestLeafIdentifiedByAWiderIndexIsNeverLabelledWhole|TestRowMovedOutOfALeafIdentifiedByItsOwnIndexIsNoDelete|TestRefusalNamesEveryPublicationOptionOn18|TestVirtualGeneratedColumnNeverMadeFullOn18|TestAnotherPublicationWithoutGeneratedColumnsKeepsATableFromFullOn18|TestInlineGuardNeverMakesAVirtualGeneratedColumnsTableFull|TestDroppedOrDetachedPartitionIsRecordedAsATruncate|TestPartitionRemovedWhileTheCaptureWasStoppedIsRecordedAtItsStart|TestDDLGuardNotifyPublishesPromptly|TestDDLGuardNotifyWithPreparedTransactions|TestDDLGuardNeverWaitsBehindAPreparedTransaction|TestCaptureExactlyOnceUnderKills)$'
cache="${EPITAPH_PG_CACHE:-/var/cache/epitaph-pg}"

skipped=()
for v in $versions; do
  if [ ! -x "/usr/lib/postgresql/$v/bin/postgres" ] && [ ! -x "$cache/$v/bin/postgres" ]; then
    if [ -n "${CI:-}" ]; then
      echo "test-pg-matrix: PostgreSQL $v server binaries are missing (in $cache/$v or /usr/lib/postgresql/$v): run make test-deps" >&2
      exit 1
    fi
    skipped+=("$v")
    continue
  fi
  echo "test-pg-matrix: PostgreSQL $v"
  EPITAPH_TEST_PG="$v" "$GO" test -p 2 -count=1 -timeout 15m -run "$run" ./internal/testenv/ ./capture/ ./e2e/
done
if [ ${#skipped[@]} -gt 0 ]; then
  echo "test-pg-matrix: SKIPPED PostgreSQL ${skipped[*]}: server binaries absent (run make test-deps; CI fails instead)" >&2
fi
