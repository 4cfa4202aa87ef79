package workload_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func setup(t *testing.T, cfg workload.SeedConfig) (string, workload.Counts) {
	t.Helper()
	url := testenv.NewDatabase(t)
	ctx := context.Background()
	require.NoError(t, workload.Setup(ctx, url))
	require.NoError(t, workload.Setup(ctx, url), "Setup is idempotent")
	c, err := workload.Seed(ctx, url, cfg)
	require.NoError(t, err)
	return url, c
}

func scalar[T any](t *testing.T, url, q string, args ...any) T {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var v T
	require.NoError(t, conn.QueryRow(ctx, q, args...).Scan(&v))
	return v
}

func TestSeedCountsAndLedger(t *testing.T) {
	t.Parallel()
	cfg := workload.SeedConfig{Customers: 3, OrdersPerCustomer: 4, LinesPerOrder: 3, ShipmentsPerOrder: 2, ItemsPerShipment: 2}
	url, c := setup(t, cfg)
	require.Equal(t, workload.Counts{Customers: 3, Orders: 12, OrderLines: 36, Shipments: 24, ShipmentItems: 48}, c)
	require.Equal(t, 1+3+2+4, cfg.RowsPerOrder())
	require.Equal(t, c.Total(), scalar[int64](t, url, "SELECT count(*) FROM workload.ledger"))
	require.Equal(t, int64(48), scalar[int64](t, url, "SELECT count(*) FROM public.shipment_items"))
	// Every shipment item refers to a line of its own shipment's order.
	require.Equal(t, int64(0), scalar[int64](t, url, `SELECT count(*) FROM public.shipment_items i
		JOIN public.shipments s ON s.id = i.shipment_id JOIN public.order_lines l ON l.id = i.order_line_id
		WHERE s.order_id <> l.order_id`))
	// Customer ids are beyond 2^53 and the ledger keeps them exactly.
	require.Equal(t, int64(workload.CustomerIDBase+1), scalar[int64](t, url,
		`SELECT (row->>'id')::bigint FROM workload.ledger WHERE table_name = 'public.customers' ORDER BY pk LIMIT 1`))
	// A second seed continues the ids.
	c2, err := workload.Seed(context.Background(), url, workload.SeedConfig{Customers: 1, OrdersPerCustomer: 1, NoLedger: true})
	require.NoError(t, err)
	require.Equal(t, int64(1), c2.Customers)
	require.Equal(t, int64(13), scalar[int64](t, url, "SELECT max(id) FROM public.orders"))
	require.Equal(t, c.Total(), scalar[int64](t, url, "SELECT count(*) FROM workload.ledger"), "NoLedger records nothing")
}

func TestExpectedAfterKnownDeletes(t *testing.T) {
	t.Parallel()
	url, _ := setup(t, workload.SeedConfig{Customers: 2, OrdersPerCustomer: 2, LinesPerOrder: 2, ShipmentsPerOrder: 1, ItemsPerShipment: 1})
	ctx := context.Background()
	exp, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Empty(t, exp)

	// Order 1 cascades to its 2 lines, 1 shipment and 1 item; item of
	// order 3 alone.
	testenv.Exec(t, url, "DELETE FROM public.orders WHERE id = 1; DELETE FROM public.shipment_items WHERE id = 3")
	exp, err = workload.Expected(ctx, url)
	require.NoError(t, err)
	got := map[string][]int64{}
	for _, r := range exp {
		require.Equal(t, 0, r.Gen)
		got[r.Table] = append(got[r.Table], r.ID)
		var row map[string]any
		require.NoError(t, json.Unmarshal(r.Row, &row))
		require.EqualValues(t, r.ID, row["id"])
	}
	require.Equal(t, map[string][]int64{
		"public.orders":         {1},
		"public.order_lines":    {1, 2},
		"public.shipments":      {1},
		"public.shipment_items": {1, 3},
	}, got)

	// Re-insert order 1 with gen 1, then delete it again: both generations
	// are expected.
	testenv.Exec(t, url, `INSERT INTO public.orders SELECT (jsonb_populate_record(NULL::public.orders, row || '{"gen":1}')).*
		FROM workload.ledger WHERE table_name = 'public.orders' AND pk = '{"id":1}'`)
	exp, err = workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Len(t, exp, 6, "the live gen 1 order is not expected")
	for _, r := range exp {
		require.Equal(t, 0, r.Gen)
	}
	testenv.Exec(t, url, "DELETE FROM public.orders WHERE id = 1")
	exp, err = workload.Expected(ctx, url)
	require.NoError(t, err)
	var gens []int
	for _, r := range exp {
		if r.Table == "public.orders" {
			gens = append(gens, r.Gen)
		}
	}
	require.Equal(t, []int{0, 1}, gens)
}

func TestRunDeletesWhatTheLedgerSays(t *testing.T) {
	t.Parallel()
	cfg := workload.SeedConfig{Customers: 40, OrdersPerCustomer: 10}
	url, c := setup(t, cfg)
	ctx := context.Background()
	res, err := workload.Run(ctx, url, workload.Plan{Seed: 7, Transactions: 60, BigTxRows: 500, Reinserts: 3, MaxOrdersPerTx: 20})
	require.NoError(t, err)
	require.Equal(t, 3, res.Reinserted)
	require.GreaterOrEqual(t, res.Transactions, 60)
	exp, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Equal(t, int64(len(exp)), res.Deleted)
	require.Greater(t, res.Deleted, int64(500), "the big transaction alone deletes about 500 rows")
	live := scalar[int64](t, url, `SELECT (SELECT count(*) FROM public.customers) + (SELECT count(*) FROM public.orders) +
		(SELECT count(*) FROM public.order_lines) + (SELECT count(*) FROM public.shipments) + (SELECT count(*) FROM public.shipment_items)`)
	require.Equal(t, c.Total()+scalar[int64](t, url, "SELECT count(*) FROM workload.ledger WHERE gen > 0"), live+res.Deleted)
	reinserted := 0
	for _, r := range exp {
		if r.Table == "public.orders" && r.Gen == 1 {
			reinserted++
		}
	}
	require.Equal(t, 3, reinserted, "each re-inserted order was deleted again")

	// The same seed over the same data makes the same choices.
	url2, _ := setup(t, cfg)
	res2, err := workload.Run(ctx, url2, workload.Plan{Seed: 7, Transactions: 60, BigTxRows: 500, Reinserts: 3, MaxOrdersPerTx: 20})
	require.NoError(t, err)
	require.Equal(t, res.Deleted, res2.Deleted)

	// A cancelled run stops and still reports what it deleted.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	res3, err := workload.Run(cctx, url2, workload.Plan{Seed: 8})
	require.NoError(t, err)
	require.Equal(t, int64(0), res3.Deleted)
}

func TestCompareFindsEveryKindOfDifference(t *testing.T) {
	t.Parallel()
	url, _ := setup(t, workload.SeedConfig{Customers: 2, OrdersPerCustomer: 3})
	ctx := context.Background()
	testenv.Exec(t, url, "DELETE FROM public.orders")
	exp, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Len(t, exp, 6*7)

	rep, err := workload.Compare(ctx, url, exp, exp)
	require.NoError(t, err)
	require.True(t, rep.OK(), rep.String())

	// The wire format's notation is equal as the column type: numeric as a
	// string, timestamptz in another zone.
	got := append([]workload.Row(nil), exp...)
	for i, r := range got {
		if r.Table == "public.orders" {
			m := decode(t, r.Row)
			m["total"] = "0" + m["total"].(json.Number).String()
			got[i].Row = mustJSON(t, m)
			break
		}
	}
	rep, err = workload.Compare(ctx, url, exp, got)
	require.NoError(t, err)
	require.True(t, rep.OK(), rep.String())

	// Missing, duplicated, unexpected, different.
	bad := append([]workload.Row(nil), exp[1:]...) // exp[0] missing
	bad = append(bad, exp[2],                      // duplicated
		workload.Row{Table: "public.orders", ID: 999, Row: json.RawMessage(`{"id":999}`)}) // unexpected
	m := decode(t, bad[5].Row)
	changed := false
	for _, k := range []string{"status", "sku", "carrier"} {
		if s, ok := m[k].(string); ok {
			m[k] = s + "x" // a text column changed
			changed = true
			break
		}
	}
	if !changed {
		m["qty"] = json.Number("77")
	}
	bad[5].Row = mustJSON(t, m)
	rep, err = workload.Compare(ctx, url, exp, bad)
	require.NoError(t, err)
	require.False(t, rep.OK())
	require.Equal(t, 1, rep.MissingCount, rep.String())
	require.Equal(t, 1, rep.DuplicatedCount, rep.String())
	require.Equal(t, 1, rep.UnexpectedCount, rep.String())
	require.Equal(t, 1, rep.DifferentCount, rep.String())
	require.Contains(t, rep.Missing[0], exp[0].Table)
}

func decode(t *testing.T, raw json.RawMessage) map[string]any {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	var m map[string]any
	require.NoError(t, d.Decode(&m))
	return m
}

func mustJSON(t *testing.T, v any) json.RawMessage {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

// TestStreamDeletesAndVerifyStream publishes delete events the way the
// capture does (one through the object store) and checks the verifier reads
// them back and judges them.
func TestStreamDeletesAndVerifyStream(t *testing.T) {
	t.Parallel()
	url, _ := setup(t, workload.SeedConfig{Customers: 1, OrdersPerCustomer: 2})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	testenv.Exec(t, url, "DELETE FROM public.orders")
	exp, err := workload.Expected(ctx, url)
	require.NoError(t, err)

	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName("main"), Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	obs, err := js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: event.RowBucket("main")})
	require.NoError(t, err)

	lsn := event.LSN(0x1000)
	publish := func(e *event.Event) {
		body, err := event.Encode(e)
		require.NoError(t, err)
		msg := nats.NewMsg(event.DeleteSubject("main", 0, e.Schema, e.Table))
		msg.Data = body
		msg.Header.Set(event.HeaderMsgID, event.MsgID("main", e.CommitLSN, e.Seq))
		_, err = js.PublishMsg(ctx, msg)
		require.NoError(t, err)
	}
	for i, r := range exp {
		schema, table, _ := cut(r.Table)
		e := &event.Event{Op: event.OpDelete, Source: "main", Schema: schema, Table: table, XID: 1, CommitLSN: lsn, Seq: i, Identity: event.IdentityFull, Key: json.RawMessage(`{"id":1}`), Row: r.Row}
		if i == 0 {
			sum := sha256.Sum256(r.Row)
			_, err := obs.PutBytes(ctx, "obj0", r.Row)
			require.NoError(t, err)
			e.Row = nil
			e.RowRef = &event.ObjectRef{Bucket: event.RowBucket("main"), Name: "obj0", Size: int64(len(r.Row)), SHA256: hex.EncodeToString(sum[:])}
		}
		publish(e)
	}
	commit, err := event.Encode(&event.Event{Op: event.OpCommit, Source: "main", CommitLSN: lsn, Rows: len(exp)})
	require.NoError(t, err)
	_, err = js.Publish(ctx, event.CommitSubject("main", 0), commit)
	require.NoError(t, err)

	events, err := workload.StreamDeletes(ctx, n.URL, "main")
	require.NoError(t, err)
	require.Len(t, events, len(exp))
	require.JSONEq(t, string(exp[0].Row), string(events[0].Row), "the object store row is read back")
	rep, err := workload.VerifyStream(ctx, url, exp, events)
	require.NoError(t, err)
	require.True(t, rep.OK(), rep.String())

	// The same event again under another stream sequence is a duplicate.
	events = append(events, events[1])
	rep, err = workload.VerifyStream(ctx, url, exp, events)
	require.NoError(t, err)
	require.Equal(t, 1, rep.DuplicatedCount)
	require.Len(t, rep.DuplicateMsgIDs, 1)
}

func cut(q string) (string, string, bool) {
	for i := range q {
		if q[i] == '.' {
			return q[:i], q[i+1:], true
		}
	}
	return "", q, false
}
