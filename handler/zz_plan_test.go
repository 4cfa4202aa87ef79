package handler

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestZZClaimPlan(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	def := e.handler("http://127.0.0.1:1/x", NewSecret(), func(d *Def) { d.BatchSize = 100 })
	_, err := e.pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, commit_time, seq, verified)
		SELECT 'main', 'public', (ARRAY['orders','lines','a','b','c'])[1 + g % 5], jsonb_build_object('id', g), jsonb_build_object('id', g), 'main:' || g,
		       ('0/' || to_hex(4096 + g * 16))::pg_lsn, now(), 0, true FROM generate_series(1, 100000) g`)
	require.NoError(t, err)
	_, err = e.pool.Exec(ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id, version, state, outcome, attempt, settled_at)
		SELECT gen_random_uuid(), $1::uuid, 'main', ('0/' || to_hex(4096 + g * 16))::pg_lsn, 0, 'public', 'orders', jsonb_build_object('id', g), 'main:' || g, 1, 'done', 'done', 1, now()
		FROM generate_series(1, 100000) g WHERE g % 5 = 0 AND g < 80000`, def.ID)
	require.NoError(t, err)
	_, err = e.pool.Exec(ctx, `UPDATE epitaph.handler_cursors SET commit_lsn = ('0/' || to_hex(4096 + 80000 * 16))::pg_lsn, seq = 0`)
	require.NoError(t, err)
	e.horizon("1/0")
	time.Sleep(2 * time.Second)
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	for _, q := range claimPlan {
		_, err := tx.Exec(ctx, q)
		require.NoError(t, err)
	}
	rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+fmt.Sprintf(cursorClaimSQL, "archive_v1.rows"), def.ID, 1, "main", "public", "orders", 100, 20, 30000, false)
	require.NoError(t, err)
	var out []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	t.Log("\n" + strings.Join(out, "\n"))
}
