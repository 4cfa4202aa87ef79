package capture

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// TestEmbeddedBrokerAndEndpoints runs the capture with its own JetStream
// server (the single-machine default), serves /metrics, /healthz and
// /status, and checks that a clean stop confirms everything acknowledged
// (the embedded server syncs its files when it shuts down).
func TestEmbeddedBrokerAndEndpoints(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	slot := dbName(t, db)
	testenv.Exec(t, db, `CREATE TABLE t (id int PRIMARY KEY, v text); ALTER TABLE t REPLICA IDENTITY FULL;
		INSERT INTO t VALUES (1, 'a'), (2, 'b')`)
	dir := t.TempDir()
	cfg := Config{
		SourceURL: db, DataDir: dir, EmbeddedListen: "127.0.0.1:0", SlotName: slot,
		Partitions: 2, HeartbeatInterval: 100 * time.Millisecond, MetricsAddr: "127.0.0.1:0",
	}
	svc := newService(t, cfg)
	require.NoError(t, svc.Start(context.Background()))
	require.True(t, strings.HasPrefix(svc.NATSURL(), "nats://127.0.0.1:"))
	testenv.Exec(t, db, `DELETE FROM t WHERE id = 1`)

	_, err := nats.Connect(svc.NATSURL())
	require.ErrorIs(t, err, nats.ErrAuthorization, "the embedded broker requires credentials")
	creds := natsconn.UserCredentials(broker.CaptureCreds(EmbeddedCredsDir(dir)))
	nc, err := nats.Connect(svc.NATSURL(), creds)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	var info *jetstream.StreamInfo
	require.Eventually(t, func() bool {
		st, err := js.Stream(ctx, "EPITAPH_MAIN")
		if err != nil {
			return false
		}
		info, err = st.Info(ctx)
		return err == nil && info.State.Msgs >= 2+2 // delete, commit, one heartbeat per partition
	}, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, "2", info.Config.Metadata[MetaPartitions])
	require.Equal(t, "main", info.Config.Metadata[MetaSource])
	require.Equal(t, "1", info.Config.Metadata[MetaWireVersion])
	require.Equal(t, jetstream.FileStorage, info.Config.Storage)
	require.Equal(t, jetstream.AsyncPersistMode, info.Config.PersistMode, "auto: async with the embedded broker")
	nc.Close()

	base := "http://" + svc.MetricsAddr()
	code, body := httpGet(t, base+"/healthz")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ok\n", body)
	require.Eventually(t, func() bool {
		_, body = httpGet(t, base+"/metrics")
		return strings.Contains(body, `epitaph_capture_events_published_total{op="delete",schema="public",table="t"} 1`) &&
			strings.Contains(body, "epitaph_capture_slot_retained_wal_bytes ")
	}, 30*time.Second, 100*time.Millisecond, body)
	for _, name := range []string{"epitaph_capture_replication_lag_bytes", "epitaph_capture_replication_lag_seconds",
		"epitaph_capture_slot_safe_wal_bytes -1", "epitaph_capture_slot_time_to_invalidation_seconds -1",
		"epitaph_capture_publish_errors_total 0", "epitaph_capture_transactions_total 1", "epitaph_capture_confirmed_lsn",
		"epitaph_capture_tables_without_full_identity 0", "epitaph_capture_heartbeat_age_seconds", "epitaph_capture_active 1",
		"epitaph_capture_large_rows_total 0"} {
		require.Contains(t, body, name)
	}
	code, body = httpGet(t, base+"/status")
	require.Equal(t, http.StatusOK, code)
	var st Status
	require.NoError(t, json.Unmarshal([]byte(body), &st))
	require.True(t, st.Active)
	require.Equal(t, slot, st.Slot)
	require.Equal(t, 2, st.Partitions)
	require.Equal(t, []string{"public.t"}, st.PublicationTables)
	require.Equal(t, "EPITAPH_MAIN", st.Stream)

	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	// A clean stop of the embedded broker synced everything it acknowledged,
	// so the slot is confirmed past the delete.
	var lsn string
	require.NoError(t, queryRow(t, db, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, []any{slot}, &lsn))
	confirmed, err := event.ParseLSN(lsn)
	require.NoError(t, err)
	var commit string
	require.NoError(t, queryRow(t, db, `SELECT pg_current_wal_lsn()::text`, nil, &commit))

	// Restart on the same data dir: the stream survives, the next delete is
	// appended once.
	svc = newService(t, cfg)
	require.NoError(t, svc.Start(context.Background()))
	testenv.Exec(t, db, `DELETE FROM t WHERE id = 2`)
	nc, err = nats.Connect(svc.NATSURL(), creds)
	require.NoError(t, err)
	defer nc.Close()
	js, err = jetstream.New(nc)
	require.NoError(t, err)
	var deletes []*event.Event
	require.Eventually(t, func() bool {
		deletes = nil
		s, err := js.Stream(ctx, "EPITAPH_MAIN")
		if err != nil {
			return false
		}
		i, err := s.Info(ctx)
		if err != nil {
			return false
		}
		for seq := uint64(1); seq <= i.State.LastSeq; seq++ {
			m, err := s.GetMsg(ctx, seq)
			if err != nil {
				return false
			}
			e, err := event.Decode(m.Data)
			require.NoError(t, err)
			if e.Op == event.OpDelete {
				deletes = append(deletes, e)
			}
		}
		return len(deletes) == 2
	}, 30*time.Second, 100*time.Millisecond)
	require.JSONEq(t, `{"id":1,"v":"a"}`, string(deletes[0].Row))
	require.JSONEq(t, `{"id":2,"v":"b"}`, string(deletes[1].Row))
	require.Greater(t, confirmed, deletes[0].CommitLSN)
}
