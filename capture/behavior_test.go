package capture

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

func TestOwnSchemasNeverPublished(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE SCHEMA epitaph; CREATE SCHEMA archive; CREATE SCHEMA archive_v1; CREATE SCHEMA archive_v12;
		CREATE TABLE epitaph.progress (id int PRIMARY KEY);
		CREATE TABLE archive.rows (id int PRIMARY KEY);
		CREATE TABLE archive_v1.rows (id int PRIMARY KEY) ;
		CREATE TABLE archive_v12.snapshots (id int PRIMARY KEY);
		CREATE TABLE public.sentinel (id int PRIMARY KEY);
		ALTER TABLE archive_v1.rows REPLICA IDENTITY FULL;
		INSERT INTO epitaph.progress VALUES (1); INSERT INTO archive.rows VALUES (1);
		INSERT INTO archive_v1.rows VALUES (1); INSERT INTO archive_v12.snapshots VALUES (1);
		INSERT INTO public.sentinel VALUES (1)`)
	svc := e.start(t, func(c *Config) { c.SetReplicaIdentityFull = true })
	require.Equal(t, []string{"public.sentinel"}, svc.CurrentStatus().PublicationTables)
	e.exec(t, `DELETE FROM epitaph.progress; DELETE FROM archive.rows; DELETE FROM archive_v1.rows;
		DELETE FROM archive_v12.snapshots; TRUNCATE archive_v1.rows`)
	e.exec(t, `DELETE FROM public.sentinel`)
	ms := e.messages(t, "main", 2)
	require.Equal(t, []string{"delete public.sentinel", "commit"}, ops(ms))
	require.Equal(t, "d", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE oid = 'archive.rows'::regclass`), "own tables are never altered")
}

func TestReplicaIdentity(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE full_t (id int PRIMARY KEY, v text);
		ALTER TABLE full_t REPLICA IDENTITY FULL;
		CREATE TABLE key_t (a int, b text, v text, PRIMARY KEY (a, b));
		CREATE TABLE nokey_t (v text, w int);
		CREATE TABLE nothing_t (id int PRIMARY KEY); ALTER TABLE nothing_t REPLICA IDENTITY NOTHING;
		INSERT INTO key_t VALUES (1, 'x', 'payload');
		INSERT INTO nokey_t VALUES ('only', 7);
		INSERT INTO full_t VALUES (1, 'f')`)

	reg := prometheus.NewRegistry()
	cfg := e.config()
	svc, err := New(cfg, WithLogger(testLogger(t)), WithRegistry(reg))
	require.NoError(t, err)
	require.NoError(t, svc.Start(context.Background()))
	st := svc.CurrentStatus()
	require.Equal(t, []string{"public.full_t", "public.key_t"}, st.PublicationTables)
	require.Len(t, st.SkippedTables, 2)
	require.Contains(t, st.SkippedTables[0], "public.nokey_t")
	require.Contains(t, st.SkippedTables[1], "public.nothing_t")
	require.Equal(t, []string{"public.key_t"}, st.KeyIdentityTables)
	require.Equal(t, 1.0, metricValue(t, svc.m.withoutFull))

	// The application's deletes on skipped tables still work.
	e.exec(t, `DELETE FROM key_t; DELETE FROM nokey_t WHERE w = 0; DELETE FROM nothing_t`)
	ms := e.deletes(t, "main", 1)
	d := ms[0].ev
	require.Equal(t, event.IdentityKey, d.Identity)
	require.JSONEq(t, `{"a":1,"b":"x"}`, string(d.Key))
	require.JSONEq(t, `{"a":1,"b":"x"}`, string(d.Row), "a key-only event carries only the key columns")
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	// With the opt-in, every table becomes FULL and is captured whole.
	svc = e.start(t, func(c *Config) { c.SetReplicaIdentityFull = true })
	st = svc.CurrentStatus()
	require.Equal(t, []string{"public.full_t", "public.key_t", "public.nokey_t", "public.nothing_t"}, st.PublicationTables)
	require.Empty(t, st.SkippedTables)
	require.Empty(t, st.KeyIdentityTables)
	for _, tb := range []string{"key_t", "nokey_t", "nothing_t"} {
		require.Equal(t, "f", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE oid = $1::regclass`, tb))
	}
	e.exec(t, `DELETE FROM nokey_t`)
	ms = e.deletes(t, "main", 2)
	d = ms[1].ev
	require.Equal(t, "nokey_t", d.Table)
	require.Equal(t, event.IdentityFull, d.Identity)
	require.Empty(t, d.Key, "no primary key: no key")
	require.JSONEq(t, `{"v":"only","w":7}`, string(d.Row))
}

func TestPartitionedTableNamesParent(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE events (id int, at date, v text, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
		CREATE TABLE events_2025 PARTITION OF events FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
		CREATE TABLE events_2026 PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
		INSERT INTO events VALUES (1, '2025-05-05', 'a'), (2, '2026-05-05', 'b')`)
	err := e.startErr(t, func(c *Config) { c.Tables = []string{"nope_events"} })
	requireFix(t, err, "does not exist")
	svc := e.start(t, func(c *Config) { c.SetReplicaIdentityFull = true })
	require.Equal(t, []string{"public.events"}, svc.CurrentStatus().PublicationTables)
	require.Equal(t, "f", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE oid = 'events_2026'::regclass`))
	e.exec(t, `DELETE FROM events`)
	ms := e.messages(t, "main", 3)
	require.Equal(t, []string{"delete public.events", "delete public.events", "commit"}, ops(ms))
	require.JSONEq(t, `{"id":1,"at":"2025-05-05","v":"a"}`, string(ms[0].ev.Row))
	require.Equal(t, map[string]int{"public.events": 2}, ms[2].ev.Tables)
}

func TestLargeRowViaObjectStore(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE docs (id int PRIMARY KEY, body text);
		ALTER TABLE docs REPLICA IDENTITY FULL;
		INSERT INTO docs SELECT 1, string_agg(md5(i::text), '') FROM generate_series(1, 160000) i;
		INSERT INTO docs VALUES (2, 'small')`)
	want := queryString(t, e.db, `SELECT md5(body) || ':' || length(body) FROM docs WHERE id = 1`)
	require.Equal(t, ":5120000", want[32:])
	reg := prometheus.NewRegistry()
	cfg := e.config()
	svc, err := New(cfg, WithLogger(testLogger(t)), WithRegistry(reg))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))
	e.exec(t, `DELETE FROM docs`)
	ms := e.messages(t, "main", 3)
	require.Equal(t, []string{"delete public.docs", "delete public.docs", "commit"}, ops(ms))
	big := ms[0].ev
	require.Empty(t, big.Row)
	require.NotNil(t, big.RowRef)
	require.Equal(t, "epitaph_main_rows", big.RowRef.Bucket)
	require.JSONEq(t, `{"id":1}`, string(big.Key))
	require.JSONEq(t, `{"id":2,"body":"small"}`, string(ms[1].ev.Row), "the next row is inline again")

	ctx := context.Background()
	obs, err := e.js.ObjectStore(ctx, big.RowRef.Bucket)
	require.NoError(t, err)
	data, err := obs.GetBytes(ctx, big.RowRef.Name)
	require.NoError(t, err)
	require.Equal(t, big.RowRef.Size, int64(len(data)))
	sum := sha256.Sum256(data)
	require.Equal(t, big.RowRef.SHA256, hex.EncodeToString(sum[:]))
	var row struct {
		ID   int    `json:"id"`
		Body string `json:"body"`
	}
	require.NoError(t, json.Unmarshal(data, &row))
	require.Equal(t, 1, row.ID)
	require.Len(t, row.Body, 5120000)

	// Restored whole from the object.
	big.Row = data
	sql, args, err := RestoreSQL(big)
	require.NoError(t, err)
	e.exec(t, sql, args...)
	require.Equal(t, want, queryString(t, e.db, `SELECT md5(body) || ':' || length(body) FROM docs WHERE id = 1`))
	require.Equal(t, 1.0, metricValue(t, svc.m.largeRows))
}

func TestCommitCascadeTruncateMark(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE parent (id int PRIMARY KEY);
		CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent ON DELETE CASCADE);
		CREATE TABLE other (id int PRIMARY KEY);
		INSERT INTO parent VALUES (1), (2);
		INSERT INTO child VALUES (10, 1), (11, 1), (12, 1), (20, 2);
		INSERT INTO other VALUES (1)`)
	e.start(t, func(c *Config) { c.SetReplicaIdentityFull = true })
	e.exec(t, `DELETE FROM parent WHERE id = 1`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.mark', 'deploy-42')`)
	e.exec(t, `BEGIN; TRUNCATE child; SELECT pg_logical_emit_message(true, 'epitaph.mark', 'in-tx'); DELETE FROM other; COMMIT`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'someone.else', 'ignored')`)
	ms := e.messages(t, "main", 5+4+1+4+1+1)
	require.Equal(t, []string{
		"delete public.parent", "delete public.child", "delete public.child", "delete public.child", "commit",
		"mark", "mark", "mark", "mark",
		"truncate public.child", "mark", "mark", "mark", "mark", "delete public.other", "commit",
	}, ops(ms))

	tx := ms[0].ev.CommitLSN
	p := event.Partition(tx, 4)
	for i := 0; i < 4; i++ {
		require.Equal(t, tx, ms[i].ev.CommitLSN)
		require.Equal(t, i, ms[i].ev.Seq)
		pp, err := event.PartitionOf(ms[i].subject)
		require.NoError(t, err)
		require.Equal(t, p, pp, "a transaction lands in one partition")
	}
	require.Equal(t, 4, ms[4].ev.Rows)
	require.Equal(t, e.tagger(t).CommitMsgID("main", tx), ms[4].msgID, "a commit's id carries the keyed tag")
	require.Equal(t, map[string]int{"public.parent": 1, "public.child": 3}, ms[4].ev.Tables)
	require.Equal(t, []event.Ref{{Columns: []string{"parent_id"}, Schema: "public", Table: "parent", RefColumns: []string{"id"}}}, ms[1].ev.Refs)

	seen := map[int]bool{}
	for _, m := range ms[5:9] {
		require.Equal(t, event.MarkUser, m.ev.Kind)
		require.Equal(t, "deploy-42", m.ev.Content)
		require.Equal(t, event.MarkSubject("main", m.ev.Partition), m.subject)
		require.Equal(t, e.tagger(t).MarkMsgID("main", m.ev.LSN, m.ev.Partition), m.msgID)
		seen[m.ev.Partition] = true
	}
	require.Len(t, seen, 4, "a mark reaches every partition")

	tr := ms[9].ev
	require.Equal(t, "child", tr.Table)
	require.Equal(t, 0, tr.Seq)
	for _, m := range ms[10:14] {
		require.Equal(t, "in-tx", m.ev.Content)
		require.Equal(t, tr.CommitLSN, m.ev.CommitLSN)
	}
	require.Equal(t, 1, ms[14].ev.Seq)
	require.Equal(t, 1, ms[15].ev.Rows, "commit rows count deletes only")
	require.Equal(t, map[string]int{"public.other": 1}, ms[15].ev.Tables)
}

func TestHeartbeatsAndIdleSlotAdvance(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE watched (id int PRIMARY KEY); CREATE TABLE busy (id int PRIMARY KEY, pad text)`)
	svc := e.start(t, func(c *Config) {
		c.Tables = []string{"watched"}
		c.HeartbeatInterval = 200 * time.Millisecond
	})
	ms := e.messages(t, "main", 4)
	for _, m := range ms[:4] {
		require.Equal(t, event.OpMark, m.ev.Op)
		require.Equal(t, event.MarkHeartbeat, m.ev.Kind)
	}
	start, err := event.ParseLSN(queryString(t, e.db, `SELECT pg_current_wal_lsn()::text`))
	require.NoError(t, err)
	// WAL from a table that is not published must not pile up behind the slot.
	e.exec(t, `INSERT INTO busy SELECT i, repeat('x', 200) FROM generate_series(1, 30000) i; DELETE FROM busy`)
	end, err := event.ParseLSN(queryString(t, e.db, `SELECT pg_current_wal_lsn()::text`))
	require.NoError(t, err)
	require.Greater(t, uint64(end-start), uint64(4<<20))
	require.Eventually(t, func() bool {
		l, err := event.ParseLSN(queryString(t, e.db, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot))
		return err == nil && l >= end
	}, 30*time.Second, 100*time.Millisecond)
	require.GreaterOrEqual(t, svc.heartbeatAge(), 0.0)
	require.Less(t, svc.heartbeatAge(), 10.0)
}

// metricValue reads a gauge's or counter's value.
func metricValue(t *testing.T, c prometheus.Collector) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 1)
	c.Collect(ch)
	var pb dto.Metric
	require.NoError(t, (<-ch).Write(&pb))
	if pb.Gauge != nil {
		return pb.Gauge.GetValue()
	}
	return pb.Counter.GetValue()
}
