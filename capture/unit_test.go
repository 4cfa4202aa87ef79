package capture

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

type fakeFuture struct {
	ok  chan *jetstream.PubAck
	err chan error
}

func newFake() *fakeFuture {
	return &fakeFuture{ok: make(chan *jetstream.PubAck, 1), err: make(chan error, 1)}
}
func (f *fakeFuture) Ok() <-chan *jetstream.PubAck { return f.ok }
func (f *fakeFuture) Err() <-chan error            { return f.err }
func (f *fakeFuture) ack()                         { f.ok <- &jetstream.PubAck{} }

func TestTrackerConfirmsOnlyAckedAndSynced(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC)
	tr := newTracker(10*time.Second, t0)
	tr.safe = 100

	a, b := newFake(), newFake()
	tr.add(a, 10, "a")
	tr.mark(200, t0) // end of tx 1
	tr.add(b, 10, "b")
	tr.mark(300, t0) // end of tx 2
	tr.mark(350, t0) // keepalive: coalesces into the previous marker
	require.Equal(t, 4, tr.len())

	require.NoError(t, tr.poll(t0))
	require.Equal(t, event.LSN(0), tr.written, "nothing acknowledged")
	require.Equal(t, event.LSN(100), tr.safeLSN(t0.Add(time.Hour)))

	b.ack() // out of order: tx 2 acked before tx 1
	require.NoError(t, tr.poll(t0.Add(time.Second)))
	require.Equal(t, event.LSN(0), tr.written, "tx 2 waits for tx 1")

	a.ack()
	require.NoError(t, tr.poll(t0.Add(2*time.Second)))
	require.Equal(t, event.LSN(350), tr.written)
	require.Equal(t, 0, tr.len())
	require.Equal(t, event.LSN(100), tr.safeLSN(t0.Add(11*time.Second)), "acks are not synced yet")
	require.Equal(t, event.LSN(350), tr.safeLSN(t0.Add(12*time.Second)))

	// Idle keepalives after everything is synced are safe at once.
	tr.mark(400, t0.Add(time.Minute))
	require.Equal(t, event.LSN(400), tr.safeLSN(t0.Add(time.Minute)))

	// A publish error is returned, never skipped.
	c := newFake()
	tr.add(c, 1, "c")
	tr.mark(500, t0)
	c.err <- errors.New("boom")
	err := tr.poll(t0)
	require.ErrorContains(t, err, "publish c: boom")
	require.Equal(t, event.LSN(400), tr.safeLSN(t0.Add(time.Hour)))
}

// TestTrackerLooseMessagesCoveredByNextAck: messages published without an
// acknowledgement count in the window and are confirmed only by the
// acknowledged publish after them; a mark made while they are loose waits
// for it; its failure names how many messages it covered.
func TestTrackerLooseMessagesCoveredByNextAck(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1000, 0)
	tr := newTracker(0, t0)
	tr.loose(10)
	tr.loose(20)
	tr.mark(100, t0) // must not confirm the loose messages
	require.Equal(t, event.LSN(0), tr.written)
	require.Equal(t, 2, tr.msgs)
	require.Equal(t, 30, tr.bytes)
	require.NoError(t, tr.drain(context.Background(), func() time.Time { return t0 }), "a stop mid-transaction leaves them unproven")
	require.Equal(t, event.LSN(0), tr.written, "and confirms nothing after them")

	a := newFake()
	tr.add(a, 5, "row 3")
	require.Equal(t, 3, tr.msgs)
	require.Equal(t, 35, tr.bytes)
	require.Equal(t, 0, tr.looseMsgs)
	require.NoError(t, tr.poll(t0))
	require.Equal(t, event.LSN(0), tr.written, "nothing acknowledged yet")
	a.ack()
	require.NoError(t, tr.poll(t0))
	require.Equal(t, event.LSN(100), tr.written, "the deferred mark follows its covering ack")
	require.Equal(t, 0, tr.msgs)
	require.Equal(t, 0, tr.bytes)

	tr.loose(1)
	tr.loose(1)
	b := newFake()
	tr.add(b, 1, "commit 0/200")
	tr.mark(200, t0)
	b.err <- errors.New("wrong last msg ID")
	err := tr.poll(t0)
	require.ErrorContains(t, err, "publish commit 0/200 (acknowledging it and the 2 messages before it): wrong last msg ID")
	require.Equal(t, event.LSN(100), tr.safeLSN(t0.Add(time.Hour)))
}

func TestTrackerWaitFrontPopsConsumedAck(t *testing.T) {
	t.Parallel()
	now := func() time.Time { return time.Unix(0, 0) }
	tr := newTracker(0, now())
	fs := make([]*fakeFuture, 5)
	for i := range fs {
		fs[i] = newFake()
		tr.add(fs[i], 1, "x")
	}
	tr.mark(10, now())
	go func() {
		for _, f := range fs {
			time.Sleep(time.Millisecond)
			f.ack()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, tr.drain(ctx, now))
	require.Equal(t, 0, tr.msgs)
	require.Equal(t, event.LSN(10), tr.safeLSN(now()))

	tr.add(newFake(), 1, "never")
	ctx2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	require.ErrorIs(t, tr.waitFront(ctx2, now), context.Canceled)
}

func TestTrackerBoundedWhenIdle(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1000, 0)
	tr := newTracker(time.Minute, t0)
	for i := 0; i < 100000; i++ {
		tr.mark(event.LSN(i+1), t0.Add(time.Duration(i)*time.Millisecond))
	}
	require.Equal(t, 0, tr.len())
	require.LessOrEqual(t, len(tr.pending), 2, "written positions coalesce")
	require.Equal(t, event.LSN(100000), tr.safeLSN(t0.Add(2*time.Minute)))
}

func TestAppendValue(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		oid       uint32
		text, out string
	}{
		{oidBool, "t", "true"},
		{oidBool, "f", "false"},
		{oidInt8, "9007199254740993", "9007199254740993"},
		{oidInt8, "-9223372036854775808", "-9223372036854775808"},
		{oidInt4, "007", `"007"`}, // never produced; kept as text rather than an invalid number
		{oidFloat8, "NaN", `"NaN"`},
		{oidFloat8, "-Infinity", `"-Infinity"`},
		{oidFloat8, "1e+100", "1e+100"},
		{oidFloat8, "-0", "-0"},
		{oidFloat4, "4.2e-05", "4.2e-05"},
		{oidNumeric, "12.50", `"12.50"`},
		{oidJSONB, `{"a": 1.10}`, `{"a": 1.10}`},
		{oidJSONB, `null`, `"null"`},
		{oidJSONB, `"s"`, `"\"s\""`},
		{25, "a\"b\\c\n\u0001<\u2028é", `"a\"b\\c\n\u0001\u003c\u2028é"`},
		{25, "bad\xffutf8", `"bad\u00ffutf8"`},
	} {
		got := string(appendValue(nil, tc.oid, []byte(tc.text)))
		require.Equal(t, tc.out, got, "oid %d %q", tc.oid, tc.text)
		require.True(t, json.Valid([]byte(got)), got)
		if tc.text != "bad\xffutf8" && tc.oid != oidBool {
			back, ok, err := ValueText(json.RawMessage(got))
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, tc.text, back)
		}
	}
	_, ok, err := ValueText(json.RawMessage("null"))
	require.NoError(t, err)
	require.False(t, ok)
}

func TestEncodeDeleteMatchesEventEncode(t *testing.T) {
	t.Parallel()
	r := &relation{schema: "public", table: "orders"}
	cols := []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "note", Type: "text"}}
	refs := []event.Ref{{Columns: []string{"c"}, Schema: "public", Table: "customers", RefColumns: []string{"id"}}}
	head, err := event.NewTableHead("main", "public", "orders", cols, refs)
	require.NoError(t, err)
	r.head = head
	for _, c := range cols {
		label, _ := json.Marshal(c.Name)
		r.cols = append(r.cols, relColumn{name: c.Name, typeOID: map[string]uint32{"bigint": oidInt8, "text": 25}[c.Type], label: append(label, ':')})
	}
	r.pkIdx = []int{0}
	var img rowImage
	tup := &pglogrepl.TupleData{Columns: []*pglogrepl.TupleDataColumn{
		{DataType: pglogrepl.TupleDataTypeText, Data: []byte("42")},
		{DataType: pglogrepl.TupleDataTypeNull},
	}}
	require.NoError(t, r.encodeRow(&img, pglogrepl.DeleteMessageTupleTypeOld, tup))
	txi := newTxInfo("main", 7431, 0x1A2B3C8, time.Date(2026, 11, 30, 9, 0, 0, 123456000, time.UTC), nil)
	tx := &txi
	got := r.encodeDelete(nil, tx, 3, &img, nil)
	want, err := event.Encode(&event.Event{
		Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders", XID: 7431,
		CommitLSN: 0x1A2B3C8, CommitTime: tx.commitTime, Seq: 3, Identity: event.IdentityFull,
		Columns: cols, Key: json.RawMessage(`{"id":42}`), Row: json.RawMessage(`{"id":42,"note":null}`), Refs: refs,
	})
	require.NoError(t, err)
	require.Equal(t, string(want), string(got))
	ev, err := event.Decode(got)
	require.NoError(t, err)
	require.Equal(t, 3, ev.Seq)

	ref := &event.ObjectRef{Bucket: "b", Name: "n", Size: 9, SHA256: "ab"}
	got = r.encodeDelete(nil, tx, 3, &img, ref)
	ev, err = event.Decode(got)
	require.NoError(t, err)
	require.Equal(t, ref, ev.RowRef)
	require.Empty(t, ev.Row)

	// Key identity: only the key columns.
	r.cols[0].key = true
	require.NoError(t, r.encodeRow(&img, pglogrepl.DeleteMessageTupleTypeKey, tup))
	require.Equal(t, event.IdentityKey, img.identity)
	require.Equal(t, `{"id":42}`, string(img.row))
}

func TestCheckTypeName(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"bigint", "numeric(12,2)", "text[]", "public.mood", `"My Schema"."odd""type"`,
		"timestamp(3) with time zone", "interval year to month", "bit varying(8)", "character varying(20)[]"} {
		require.NoError(t, checkTypeName(ok), ok)
	}
	for _, bad := range []string{"", "int; DROP TABLE x", "int)--", "int) FROM (SELECT 1", `"unterminated`, "int[", "text /* c */"} {
		require.Error(t, checkTypeName(bad), bad)
	}
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	require.Equal(t, "postgres://bob:xxxxx@h:5432/db?sslmode=disable", RedactURL("postgres://bob:s3cret@h:5432/db?sslmode=disable"))
	require.Equal(t, "postgres://bob@h/db", RedactURL("postgres://bob@h/db"))
	require.NotContains(t, RedactURL("postgres://h/db?password=s3cret"), "s3cret")
	require.Equal(t, "host=h password=xxxxx dbname=d", RedactURL("host=h password=s3cret dbname=d"))
	require.Equal(t, "host=h password=xxxxx dbname=d", RedactURL("host=h password='s3 cret' dbname=d"))
	require.Equal(t, "nats://u:xxxxx@n:4222", RedactURL("nats://u:pw@n:4222"))
	require.Equal(t, "connect postgres://bob:xxxxx@h/db: refused", RedactURL("connect postgres://bob:p@ss@h/db: refused"))
}

func TestPositions(t *testing.T) {
	t.Parallel()
	p, err := parsePosition("1/2A#7")
	require.NoError(t, err)
	require.Equal(t, position{lsn: 0x10000002A, n: 7}, p)
	require.Equal(t, "1/2A#7", p.String())
	require.True(t, position{lsn: 0x10000002A, n: 8}.after(p))
	require.True(t, position{lsn: 0x10000002B, n: 0}.after(p))
	require.False(t, p.after(p))
	for _, bad := range []string{"", "1/2A", "x#1", "1/2#-1"} {
		_, err := parsePosition(bad)
		require.Error(t, err, bad)
	}
}

func TestPlanSlot(t *testing.T) {
	t.Parallel()
	s := func(v string) *string { return &v }
	pid := int32(77)
	tl := tail{has: true, pos: position{lsn: 0x100}}
	healthy := slotState{exists: true, slotType: "logical", plugin: "pgoutput", database: "db", confirmed: s("0/100")}

	p, err := planSlot(slotState{}, "epitaph", "db", tail{}, "EPITAPH_MAIN", false)
	require.NoError(t, err)
	require.Equal(t, slotPlan{create: true}, p, "first start")

	_, err = planSlot(slotState{}, "epitaph", "db", tl, "EPITAPH_MAIN", false)
	requireFix(t, err, "missing", "--recreate-slot")
	p, err = planSlot(slotState{}, "epitaph", "db", tl, "EPITAPH_MAIN", true)
	require.NoError(t, err)
	require.True(t, p.create)
	require.NotEmpty(t, p.gap)

	p, err = planSlot(healthy, "epitaph", "db", tl, "EPITAPH_MAIN", true)
	require.NoError(t, err)
	require.Equal(t, slotPlan{}, p, "a healthy slot is never dropped, even with --recreate-slot")

	lost := healthy
	lost.walStatus = s("lost")
	_, err = planSlot(lost, "epitaph", "db", tl, "EPITAPH_MAIN", false)
	requireFix(t, err, "invalidated", "--recreate-slot")
	p, err = planSlot(lost, "epitaph", "db", tl, "EPITAPH_MAIN", true)
	require.NoError(t, err)
	require.True(t, p.drop && p.create && p.gap != "")

	// PostgreSQL 18 invalidates a slot inactive for longer than
	// idle_replication_slot_timeout: wal_status need not say lost.
	idle := healthy
	idle.walStatus, idle.invalidation = s("reserved"), "idle_timeout"
	_, err = planSlot(idle, "epitaph", "db", tl, "EPITAPH_MAIN", false)
	requireFix(t, err, "invalidated (idle_timeout: inactive longer than idle_replication_slot_timeout)", "--recreate-slot")
	p, err = planSlot(idle, "epitaph", "db", tl, "EPITAPH_MAIN", true)
	require.NoError(t, err)
	require.True(t, p.drop && p.create)
	require.Contains(t, p.gap, "idle_replication_slot_timeout")

	active := healthy
	active.activePID = &pid
	_, err = planSlot(active, "epitaph", "db", tl, "EPITAPH_MAIN", false)
	requireFix(t, err, "active in process 77")

	other := healthy
	other.database = "else"
	_, err = planSlot(other, "epitaph", "db", tl, "EPITAPH_MAIN", false)
	requireFix(t, err, `belongs to database "else"`)

	phys := healthy
	phys.slotType, phys.plugin = "physical", ""
	_, err = planSlot(phys, "epitaph", "db", tl, "EPITAPH_MAIN", false)
	requireFix(t, err, "logical pgoutput slot")
}
