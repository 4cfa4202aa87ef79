package readapi

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// The snapshots of a root, paged across a promotion: a rebuilt version
// numbers its documents in an order and from a start of its own, so a
// cursor must name a document by what every version shares (its
// transaction), not by the version's row id. Paged by id, the second page
// read from the new version repeated the first page's document (and,
// the other way round, skips them).
func TestReadAPISnapshotPagesAcrossAPromotionRepeatAndSkipNone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, snapshot.DDL))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return version.CreateVersionTables(ctx, tx, version.Version{Projection: archive.Projection, Version: 2, Schema: archive.Schema(2)}, snapshot.DDL)
	}))
	// Customer 42 deleted in three transactions. Version 1 made other
	// documents first (ids 1..500, then 42's), version 2 made 42's
	// first (ids 1..3).
	const docs = `INSERT INTO %s.snapshots (correlation_id, root_table, root_key, status, source, commit_lsn, root_seq)
		SELECT 'main:' || g || ':0/' || to_hex(g * 256), 'public.customers', $1::jsonb, 'complete', 'main', ('0/' || to_hex(g * 256))::pg_lsn, 0
		FROM generate_series($2::int, $3::int) g`
	for _, step := range []struct {
		schema, key string
		from, to    int
	}{
		{"archive_v1", `{"id": 1}`, 1000, 1499}, {"archive_v1", `{"id": 42}`, 1, 3},
		{"archive_v2", `{"id": 42}`, 1, 3}, {"archive_v2", `{"id": 1}`, 1000, 1499},
	} {
		_, err := pool.Exec(ctx, fmt.Sprintf(docs, step.schema), step.key, step.from, step.to)
		require.NoError(t, err)
	}
	a := &api{cfg: Config{DB: pool}}
	page := func(cursor map[string]any) ([]string, map[string]any) {
		req := &request{limit: 1, schema: "public", table: "customers", key: `{"id": 42}`, cursor: cursor}
		require.NoError(t, req.validCursor())
		p, err := a.snapshots(ctx, nil, req)
		require.NoError(t, err)
		var corrs []string
		for _, it := range p.items {
			var s struct {
				CorrelationID string `json:"correlation_id"`
			}
			require.NoError(t, json.Unmarshal(it, &s))
			corrs = append(corrs, s.CorrelationID)
		}
		if p.next == "" {
			return corrs, nil
		}
		var next map[string]any
		b, err := base64.RawURLEncoding.DecodeString(p.next)
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(b, &next))
		return corrs, next
	}
	first, cursor := page(nil)
	require.Equal(t, []string{"main:3:0/300"}, first, "newest first")
	require.NotNil(t, cursor)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return version.PointViews(ctx, tx, 2) }))
	var rest []string
	for n := 0; cursor != nil; n++ {
		require.Less(t, n, 10)
		var got []string
		got, cursor = page(cursor)
		rest = append(rest, got...)
	}
	require.Equal(t, []string{"main:2:0/200", "main:1:0/100"}, rest, "the pages after the promotion")
}
