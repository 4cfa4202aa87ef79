package main

import (
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
)

// A restore the source refuses with an error that quotes the row's value
// (a validation trigger's here; Postgres's "invalid input value" errors do
// the same) prints the error sanitized on stderr, as epitaph.restores and
// the console keep it: a job's stderr ends up in logs that more people read
// than the archive, and that an erasure cannot reach.
func TestRestoreCommandFailureHidesRowValues(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE public.notes (id bigint PRIMARY KEY, body text NOT NULL)`)
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	createMainStream(t, js, 1)
	const value = "row-value-9034@example.com"
	lsn := event.LSN(0x1000100)
	pub := func(subject, id string, ev *event.Event) {
		b, err := event.Encode(ev)
		require.NoError(t, err)
		m := nats.NewMsg(subject)
		m.Data = b
		m.Header.Set(event.HeaderMsgID, id)
		signerFor(js).Sign(m)
		_, err = js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	pub(event.DeleteSubject("main", 0, "public", "notes"), event.MsgID("main", lsn, 0), &event.Event{
		Op: event.OpDelete, Source: "main", Schema: "public", Table: "notes", XID: 99, CommitLSN: lsn, Seq: 0,
		CommitTime: time.Now().UTC(), Identity: event.IdentityFull,
		Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "body", Type: "text"}},
		Key:     json.RawMessage(`{"id":7}`), Row: json.RawMessage(`{"id":7,"body":"` + value + `"}`)})
	pub(event.CommitSubject("main", 0), event.CommitMsgID("main", lsn), &event.Event{
		Op: event.OpCommit, Source: "main", XID: 99, CommitLSN: lsn, CommitTime: time.Now().UTC(), Rows: 1,
		Tables: map[string]int{"public.notes": 1}})
	svc, err := projection.New(projection.Config{TargetURL: url, NATSURL: n.URL, SourceName: "main", WorkerID: "w1",
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond}, projection.WithLogger(slog.New(slog.DiscardHandler)),
		projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	corr := event.CorrelationID("main", 99, lsn)
	require.Eventually(t, func() bool {
		var c int
		return conn.QueryRow(ctx, `SELECT count(*) FROM archive.rows WHERE correlation_id = $1`, corr).Scan(&c) == nil && c == 1
	}, 60*time.Second, 50*time.Millisecond)
	testenv.Exec(t, url, `CREATE FUNCTION public.notes_check() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'note body "%" is not allowed', NEW.body; END $$;
		CREATE TRIGGER notes_check BEFORE INSERT ON public.notes FOR EACH ROW EXECUTE FUNCTION public.notes_check()`)

	code, out, stderr := projector(t, map[string]string{"EPITAPH_SOURCE_URL": url}, "restore", "--correlation", corr, "--actor", "erin")
	require.Equal(t, 1, code, "%s%s", out, stderr)
	require.Contains(t, stderr, "SQLSTATE P0001", "stderr still says what failed")
	require.NotContains(t, stderr, value, "stderr hides the row's value")
	var recorded string
	require.NoError(t, conn.QueryRow(ctx, `SELECT error FROM epitaph.restores WHERE actor = 'erin'`).Scan(&recorded))
	require.NotContains(t, recorded, value)
}
