package revalidate_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// recorder is a Go handler that remembers every call.
type recorder struct {
	mu    sync.Mutex
	calls []handler.Delivery
}

func (r *recorder) Handle(_ context.Context, d handler.Delivery) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, d)
	return nil
}

func (r *recorder) ids() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.calls))
	for i, d := range r.calls {
		out[i] = d.ID
	}
	return out
}

const goHandler = "00000000-0000-4000-8000-0000000000aa"

// dispatcher is the real dispatcher with the evaluator as its seam, and a
// Go handler (backoff 50 ms) on customers.
func (e *env) dispatcher() (*handler.Dispatcher, *recorder) {
	e.t.Helper()
	e.exec(`INSERT INTO epitaph.handlers (id, schema_name, table_name, kind, target, backoff)
		VALUES ($1, 'public', 'customers', 'go', 'recorder', '50 milliseconds')`, goHandler)
	rec := &recorder{}
	reg := handler.NewRegistry()
	require.NoError(e.t, reg.Register("recorder", rec))
	d, err := handler.NewDispatcher(e.target, handler.Config{Registry: reg, Revalidate: e.ev.Revalidator(), RevalidateBatch: e.ev.BatchRevalidator(),
		Poll: 50 * time.Millisecond, Logger: testLogger(), Registerer: prometheus.NewRegistry()})
	require.NoError(e.t, err)
	return d, rec
}

func (e *env) flush(d *handler.Dispatcher, timeout time.Duration) int {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(e.ctx, timeout)
	defer cancel()
	left, err := d.Flush(ctx)
	if err != nil || left > 0 {
		rows, qerr := e.target.Query(e.ctx, `SELECT id, state, attempt, defers, outcome, next_attempt_at - now(), claim_expires_at - now(), released_at IS NOT NULL FROM epitaph.deliveries`)
		require.NoError(e.t, qerr)
		for rows.Next() {
			v, _ := rows.Values()
			e.t.Logf("delivery %v", v)
		}
		rows.Close()
	}
	require.NoError(e.t, err)
	return left
}

func (e *env) state(id string) (state string, attempt, defers int) {
	e.t.Helper()
	require.NoError(e.t, e.target.QueryRow(e.ctx, `SELECT state, attempt, defers FROM epitaph.deliveries WHERE id = $1`, id).
		Scan(&state, &attempt, &defers))
	return state, attempt, defers
}

// The source down: the dispatcher defers without spending an attempt (the
// handler is never called), and sends once the source is back.
func TestDispatcherDefersWhileTheSourceIsDown(t *testing.T) {
	pg := testenv.NewPostgres(t)
	e := setupWith(t, pg.NewDatabase(t))
	d, rec := e.dispatcher()
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(goHandler, g, 0, 1)

	require.NoError(t, pg.Stop())
	// The running dispatcher (not stopped in between: a soft stop racing
	// its claim can leave a claim behind until it expires).
	require.NoError(t, d.Start(e.ctx))
	defer func() { require.NoError(t, d.Stop(e.ctx)) }()
	require.Eventually(t, func() bool {
		state, attempt, defers := e.state(id)
		return state == "pending" && attempt == 0 && defers >= 2
	}, 90*time.Second, 20*time.Millisecond, "deferred twice, no attempt spent")
	require.Equal(t, "defer", e.delivery(`id = $1`, id).Outcome)
	require.Empty(t, rec.ids(), "never sent while the source is down")

	require.NoError(t, pg.Start())
	require.Eventually(t, func() bool { state, _, _ := e.state(id); return state == "done" }, 90*time.Second, 20*time.Millisecond)
	_, attempt, _ := e.state(id)
	require.Equal(t, 1, attempt, "the only attempt is the one that sent")
	require.Equal(t, []string{id}, rec.ids())
}

// Through the dispatcher: a changed set is sent once, for the current set,
// and a key deleted twice is sent once, for the later deletion.
func TestDispatcherSendsOnlyWhatStillStands(t *testing.T) {
	e := setup(t)
	d, rec := e.dispatcher()
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	changed := e.queue(goHandler, g, 0, 1)
	e.archive(g, 1, 2, "bob") // late; its own delivery:
	late := e.queue(goHandler, g, 1, 2)

	g1, g2 := e.newGroup(), e.newGroup()
	e.archive(g1, 0, 7, "eve")
	older := e.queue(goHandler, g1, 0, 7)
	e.archive(g2, 0, 7, "eve II")
	newer := e.queue(goHandler, g2, 0, 7)

	require.Zero(t, e.flush(d, 90*time.Second))
	next := e.delivery(`handler_id = $1 AND commit_lsn = $2::pg_lsn AND seq = 0 AND generation = 1`, goHandler, g.lsn)
	require.ElementsMatch(t, []string{next.ID, late, newer}, rec.ids())
	for id, want := range map[string]string{changed: "stop_changed", older: "stop_superseded", next.ID: "done", late: "done", newer: "done"} {
		require.Equal(t, want, e.delivery(`id = $1`, id).Outcome, id)
	}
	state, _, _ := e.state(changed)
	require.Equal(t, "stopped", state)
	for _, c := range rec.calls {
		if c.ID == next.ID {
			require.JSONEq(t, `{"rows":2,"added":[{"id":2}]}`, string(c.Group), "the handler hears of the row added")
			require.JSONEq(t, `{"id":1}`, string(c.Key))
		}
	}
}
