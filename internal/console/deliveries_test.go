package console_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestConsoleDeliveriesSelection: of 10 dead deliveries, a retry of 3 by
// id (with the Bearer token) delivers exactly those 3 and leaves the other
// 7 dead; a discard of 3 others stops exactly those, leaving 4 dead; a
// selection without the token is 401 and changes nothing, and an id the
// action does not apply to is named in the answer's failures.
func TestConsoleDeliveriesSelection(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t)
	recv := &receiver{accepted: map[string]int{}}
	recv.failing.Store(true)
	hook := httptest.NewServer(recv)
	t.Cleanup(hook.Close)
	require.NoError(t, handler.Add(ctx, e.target, handler.Def{ID: handler.NewID(), Name: "notes-hook", Schema: "public", Table: "notes",
		Kind: handler.KindWebhook, Target: hook.URL + "/hook", MaxAttempts: 1,
		Backoff: 20 * time.Millisecond, ClaimTimeout: 30 * time.Second}))
	testenv.Exec(t, e.src, `INSERT INTO public.notes SELECT g, 'note ' || g FROM generate_series(1, 10) g; DELETE FROM public.notes`)
	e.caughtUp()

	// states maps each notes delivery's key (its note id) to its state.
	states := func() map[int]string {
		rows, err := e.target.Query(ctx, `SELECT (key->>'id')::int, state FROM epitaph.deliveries WHERE table_name = 'notes'`)
		require.NoError(t, err)
		defer rows.Close()
		out := map[int]string{}
		for rows.Next() {
			var id int
			var s string
			require.NoError(t, rows.Scan(&id, &s))
			out[id] = s
		}
		require.NoError(t, rows.Err())
		return out
	}
	want := map[int]string{}
	for i := 1; i <= 10; i++ {
		want[i] = handler.StateDead
	}
	deadline := time.Now().Add(120 * time.Second)
	for e.count(`SELECT count(*) FROM epitaph.deliveries WHERE table_name = 'notes' AND state = 'dead'`) != 10 {
		require.True(t, time.Now().Before(deadline), "10 deliveries go dead: %v", states())
		time.Sleep(100 * time.Millisecond)
	}
	require.Equal(t, want, states())
	ids := map[int]string{}
	rows, err := e.target.Query(ctx, `SELECT (key->>'id')::int, id::text FROM epitaph.deliveries WHERE table_name = 'notes'`)
	require.NoError(t, err)
	for rows.Next() {
		var k int
		var id string
		require.NoError(t, rows.Scan(&k, &id))
		ids[k] = id
	}
	require.NoError(t, rows.Err())
	selection := func(keys ...int) string {
		var quoted []string
		for _, k := range keys {
			quoted = append(quoted, fmt.Sprintf("%q", ids[k]))
		}
		return "[" + strings.Join(quoted, ", ") + "]"
	}
	answer := func(code int, text string) console.DeliveriesAnswer {
		t.Helper()
		var a console.DeliveriesAnswer
		require.NoError(t, json.Unmarshal([]byte(text), &a), "%d %s", code, text)
		return a
	}
	recv.failing.Store(false)
	bearer := "Bearer " + token

	// Without the token: 401 for either action, nothing changes.
	for _, act := range []string{"retry", "discard"} {
		code, text := post(t, e.console.URL, "/console/api/deliveries", `{"action": "`+act+`", "ids": `+selection(2, 5, 9)+`}`)
		require.Equal(t, http.StatusUnauthorized, code, text)
	}
	require.Equal(t, want, states())

	// Retry 3 of the 10: exactly those are delivered, once each.
	code, text := post(t, e.console.URL, "/console/api/deliveries", `{"action": "retry", "ids": `+selection(2, 5, 9)+`}`, "Authorization", bearer)
	require.Equal(t, http.StatusOK, code, text)
	require.Equal(t, console.DeliveriesAnswer{Action: "retry", Done: 3, Failed: map[string]string{}}, answer(code, text))
	for _, k := range []int{2, 5, 9} {
		want[k] = handler.StateDone
	}
	deadline = time.Now().Add(60 * time.Second)
	for recv.keys() < 3 || e.count(`SELECT count(*) FROM epitaph.deliveries WHERE table_name = 'notes' AND state = 'done'`) < 3 {
		require.True(t, time.Now().Before(deadline), "the 3 retried are delivered: %v", states())
		time.Sleep(50 * time.Millisecond)
	}
	require.Equal(t, want, states(), "exactly the 3 retried are delivered, the other 7 still dead")
	recv.mu.Lock()
	require.Equal(t, map[string]int{`{"id":2}`: 1, `{"id":5}`: 1, `{"id":9}`: 1}, recv.accepted, "the receiver got those 3 rows, once each")
	recv.mu.Unlock()

	// Discard 3 others, plus one already delivered: that one is named as
	// failed, the 3 are stopped, 4 stay dead.
	code, text = post(t, e.console.URL, "/console/api/deliveries", `{"action": "discard", "ids": `+selection(1, 4, 10, 2)+`}`, "Authorization", bearer)
	require.Equal(t, http.StatusOK, code, text)
	a := answer(code, text)
	require.Equal(t, 3, a.Done)
	require.Len(t, a.Failed, 1)
	require.Contains(t, a.Failed[ids[2]], "done or stopped already")
	for _, k := range []int{1, 4, 10} {
		want[k] = handler.StateStopped
	}
	require.Equal(t, want, states(), "exactly the 3 discarded are stopped; 3 done, 4 dead")
	require.Equal(t, 3, e.count(`SELECT count(*) FROM epitaph.deliveries WHERE table_name = 'notes' AND outcome = 'discarded'`))
	// Nothing more reaches the receiver: the discarded are never sent.
	require.Equal(t, 3, recv.keys())
}
