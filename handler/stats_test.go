package handler

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// A deliveries table that grew past its statistics (a backlog queued in a
// burst) is analyzed by the dispatcher (in the background of its claim loop, and
// by Flush), once, on the columns its statements filter on; a table whose
// statistics are current is not analyzed again.
func TestMaintainAnalyzesTablesThatOutgrewTheirStatistics(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	e.addHandler(KindGo, "noop")
	rows := make([]Row, 0, 2*analyzeMinRows)
	for i := range 2 * analyzeMinRows {
		rows = append(rows, e.row(i))
	}
	e.enqueue(1, rows...)
	d := e.dispatcher(Config{})
	analyzed := func() int {
		var n int
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT analyze_count FROM pg_stat_user_tables
			WHERE relid = 'epitaph.deliveries'::regclass`).Scan(&n))
		return n
	}
	require.Zero(t, analyzed())
	// The inserts reach the statistics collector within a second or so;
	// the running dispatcher (no handler of this process: nothing is
	// claimed) looks every second.
	require.NoError(t, d.Start(ctx))
	eventually(t, func() bool { return analyzed() > 0 }, "the grown deliveries table analyzed")
	require.NoError(t, d.Stop(ctx))
	require.Equal(t, 1, analyzed())
	for range 3 {
		require.NoError(t, d.analyzeGrown(ctx))
	}
	require.Equal(t, 1, analyzed(), "not analyzed again: its statistics are current")
}
