package handler

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// applyMigrationsUpTo applies the embedded migrations up to last, as a
// build that knew only those did.
func applyMigrationsUpTo(t *testing.T, pool *pgxpool.Pool, last int) {
	t.Helper()
	ctx := context.Background()
	all, err := migrations.All()
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS epitaph;
		CREATE TABLE IF NOT EXISTS epitaph.schema_migrations (version integer PRIMARY KEY, name text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	for _, m := range all {
		if m.Version > last {
			break
		}
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("%04d_%s: %w", m.Version, m.Name, err)
			}
			_, err := tx.Exec(ctx, `INSERT INTO epitaph.schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name)
			return err
		}))
	}
}

// A batching webhook without revalidation added by a build before
// migration 0021 (handler cursors) keeps delivering after the upgrade:
// the deliveries the old build queued go out, and so does every row
// archived after the upgrade, each once.
// oldBuildEnv is a target as a build before migration 0021 left it: its
// migrations up to 0020, a live archive, and a batching webhook without
// revalidation to target (not a cursor handler then).
func oldBuildEnv(t *testing.T, target, secret string) (*cursorEnv, Def) {
	t.Helper()
	ctx := context.Background()
	dsn := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	applyMigrationsUpTo(t, pool, 20)
	require.NoError(t, version.EnsureArchive(ctx, pool, 2, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: target, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: time.Second,
		SecretFile: writeSecret(t, secret), Columns: []string{}, Phase: PhaseImmediate}
	require.NoError(t, def.Validate())
	require.True(t, def.UsesCursor())
	_, err = pool.Exec(ctx, addSQL, def.ID, def.Name, def.Schema, def.Table, def.Kind, def.Target, def.Priority, def.Phase,
		def.Columns, def.MaxAttempts, def.Backoff.Milliseconds(), def.ClaimTimeout.Milliseconds(), def.SecretFile,
		def.Revalidate, def.SourceURLFile, def.BatchSize, def.BatchWait.Milliseconds())
	require.NoError(t, err)
	return &cursorEnv{t: t, dsn: dsn, pool: pool, lsn: 0x1000}, def
}

// archiveAsOldBuild archives rows of public.orders and queues a delivery
// of def for each, as the apply of a build before migration 0021 did.
func (e *cursorEnv) archiveAsOldBuild(def Def, keys ...int) []string {
	e.t.Helper()
	ctx := context.Background()
	lsns := e.archive("orders", true, keys...)
	var a enqueueArgs
	for i, k := range keys {
		ct := time.Now()
		r := Row{Source: "main", Schema: "public", Table: "orders", Key: []byte(fmt.Sprintf(`{"id": %d}`, k)),
			CorrelationID: "main:" + lsns[i], CommitLSN: lsns[i], CommitTime: &ct, Verified: true, Committed: true}
		a.add(def, &r, fmt.Sprintf(`{"key": {"id": %d}, "columns": {}}`, k), true)
	}
	require.NoError(e.t, pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		_, err := a.insert(ctx, tx, "archive", 1)
		return err
	}))
	return lsns
}

// A batching webhook without revalidation added by a build before
// migration 0021 (handler cursors) keeps delivering after the upgrade:
// the deliveries the old build queued go out, and so does every row
// archived after the upgrade, each once.
func TestBatchingWebhookAddedBeforeHandlerCursorsDeliversAfterTheUpgrade(t *testing.T) {
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers())
	e, def := oldBuildEnv(t, srv.URL, secret)
	old := e.archiveAsOldBuild(def, 1, 2)
	e.horizon(old[1])

	// The upgrade (docs/upgrade.md, section 2), then the new build
	// archives two more rows.
	require.NoError(t, migrations.Apply(ctx, e.pool))
	fresh := e.archive("orders", true, 1, 3)
	e.horizon(fresh[1])

	e.flush(e.dispatcher())
	sent := sentIDs(br)
	require.ElementsMatch(t, idsOf(def.ID, old[0], old[1], fresh[0], fresh[1]), sent,
		"every row of the handler's table, queued by the old build or archived after the upgrade, delivered once")
	var key1 []string
	for _, id := range sent {
		if id == idsOf(def.ID, old[0])[0] || id == idsOf(def.ID, fresh[0])[0] {
			key1 = append(key1, id)
		}
	}
	require.Equal(t, idsOf(def.ID, old[0], fresh[0]), key1, "key 1's deliveries in commit order")
}

// A key's deliveries stay in commit order across the upgrade (DESIGN 10:
// "deliveries of one (table, key) stay in order"): a delivery the old
// build queued that waits for its retry goes out before the same key's
// later deletion, which the new build's cursor sends.
func TestKeysDeliveryQueuedBeforeHandlerCursorsGoesOutBeforeItsLaterOne(t *testing.T) {
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers())
	e, def := oldBuildEnv(t, srv.URL, secret)
	old := e.archiveAsOldBuild(def, 1)
	e.horizon(old[0])
	// The old build's attempt failed: it waits for its retry.
	_, err := e.pool.Exec(ctx, `UPDATE epitaph.deliveries SET attempt = 1, next_attempt_at = now() + interval '2 seconds'
		WHERE handler_id = $1`, def.ID)
	require.NoError(t, err)

	require.NoError(t, migrations.Apply(ctx, e.pool))
	// Key 1 is inserted again and deleted again, archived by the new build.
	fresh := e.archive("orders", true, 1)
	e.horizon(fresh[0])

	d := e.dispatcher()
	startUntilCleanup(t, d)
	eventually(t, func() bool { return len(sentIDs(br)) >= 2 }, "both deliveries of key 1 sent")
	require.Equal(t, idsOf(def.ID, old[0], fresh[0]), sentIDs(br), "key 1's deliveries in commit order")
}
