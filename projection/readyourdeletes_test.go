package projection_test

import (
	"context"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// Read your deletes with the real capture: DELETE in the source, take
// pg_current_wal_insert_lsn(), WaitLSN returns, and the row is in
// archive.rows. (pg_current_wal_lsn() is the WAL *write* position: with
// synchronous_commit = off, as on the test server, it can be behind the
// session's own commit; the insert position never is.)
// The delete lands in one partition of four; the other three reach the
// LSN through the capture's heartbeats.
func TestReadYourDeletesWithCapture(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srcURL := testenv.NewDatabase(t)
	testenv.Exec(t, srcURL, `CREATE TABLE public.items (id bigint PRIMARY KEY, v text);
		ALTER TABLE public.items REPLICA IDENTITY FULL;
		INSERT INTO public.items SELECT g, 'item ' || g FROM generate_series(1, 20) g`)
	u, err := url.Parse(srcURL)
	require.NoError(t, err)
	n := testenv.NewNATS(t)
	capSvc, err := capture.New(capture.Config{
		SourceURL: srcURL, NATSURL: n.URL, DataDir: t.TempDir(), SourceName: src, Tables: []string{"public.items"}, Partitions: 4,
		SlotName: strings.TrimPrefix(u.Path, "/"), PublicationName: "ryd", HeartbeatInterval: 200 * time.Millisecond,
		BrokerSyncInterval: -1, MetricsAddr: "127.0.0.1:0",
	}, capture.WithLogger(testLogger(t)), capture.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, capSvc.Start(ctx))
	t.Cleanup(func() { require.NoError(t, capSvc.Stop(context.Background())) })

	e := &env{t: t, url: testenv.NewDatabase(t), nats: n, partitions: 4}
	_, e.js = n.Connect(t)
	e.start(e.config("w1"))
	pool := e.pool()
	c := e.conn()
	source, err := pgx.Connect(ctx, srcURL)
	require.NoError(t, err)
	t.Cleanup(func() { source.Close(context.Background()) })

	for id := 1; id <= 5; id++ {
		_, err := source.Exec(ctx, `DELETE FROM public.items WHERE id = $1`, id)
		require.NoError(t, err)
		var current string
		require.NoError(t, source.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&current))
		lsn, err := event.ParseLSN(current)
		require.NoError(t, err)
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		at, err := status.WaitLSN(wctx, pool, archive.Projection, lsn, 0)
		cancel()
		require.NoError(t, err)
		require.GreaterOrEqual(t, at, lsn)
		if count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'items' AND key->>'id' = $1`, strconv.Itoa(id)) != 1 {
			// Diagnostics: where every partition stands, and the stream.
			rows, _ := c.Query(ctx, `SELECT partition, cursor, COALESCE(last_commit_lsn::text, '-'), COALESCE(source_lsn::text, '-')
				FROM epitaph.progress ORDER BY 1`)
			for rows.Next() {
				var p, cur int64
				var a, b string
				_ = rows.Scan(&p, &cur, &a, &b)
				t.Logf("progress p%d cursor %d last %s source %s", p, cur, a, b)
			}
			rows.Close()
			t.Logf("current %s at %s", current, at)
			stream, _ := e.js.Stream(ctx, event.StreamName(src))
			info, _ := stream.Info(ctx)
			for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
				m, err := stream.GetMsg(ctx, seq)
				if err != nil {
					continue
				}
				ev, err := (&event.Decoder{}).Decode(m.Data)
				if err != nil {
					continue
				}
				t.Logf("%d %s op=%s lsn=%s commit=%s", seq, m.Subject, ev.Op, ev.LSN, ev.CommitLSN)
			}
		}
		require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'items' AND key->>'id' = $1`, strconv.Itoa(id)),
			"delete of %d visible right after the wait", id)
		// One delete, one partition: the three others reached the LSN by
		// the heartbeats the capture fans out.
		require.Equal(t, 4, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE version = 1 AND source_lsn >= $1::pg_lsn`, current))
	}
}
