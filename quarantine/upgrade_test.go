package quarantine_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// An entry quarantined before migration 0024 (entries name their stream)
// is still the one a re-delivery of its message bumps after the upgrade,
// not a second entry: the migration gives it the stream its partition's
// cursor counts in, when it was first seen after that stream was made.
func TestEntryFromBeforeStreamNamesIsBumpedByItsRedelivery(t *testing.T) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	all, err := migrations.All()
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS epitaph;
		CREATE TABLE IF NOT EXISTS epitaph.schema_migrations (version integer PRIMARY KEY, name text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	for _, m := range all {
		if m.Version >= 24 {
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
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.progress (projection, version, partition, stream_created)
		VALUES ('archive', 1, 0, now() - interval '1 hour')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.quarantine (projection, version, partition, stream_seq, subject, data, category, error)
		VALUES ('archive', 1, 0, 7, 'epitaph.main.p0.commit', 'x', 'malformed', 'bad')`)
	require.NoError(t, err)

	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return quarantine.Insert(ctx, tx, quarantine.Entry{Projection: "archive", Version: 1, Partition: 0, StreamSeq: 7,
			Subject: "epitaph.main.p0.commit", Data: []byte("x"), Category: "malformed", Error: "bad"})
	}))
	var n, attempts int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), max(attempts) FROM epitaph.quarantine`).Scan(&n, &attempts))
	require.Equal(t, 1, n, "one entry")
	require.Equal(t, 2, attempts, "the re-delivery bumped it")
}
