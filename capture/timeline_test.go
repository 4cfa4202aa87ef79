package capture

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// TestPromotionBehindTheStreamIsNotSkippedSilently: a standby promoted
// while it lagged the primary (here without synchronized_standby_slots,
// which holds the capture back until the standby has the WAL) starts a new
// timeline at a position before WAL the capture had already published from
// the old primary. Its synced slot survives. Once the new primary's WAL
// reaches the stream's last position, a capture resuming "after the last
// message the stream proves" takes deletes of the new timeline that lie
// before that position for ones it already published, and drops them. The
// capture must not resume silently past them: it publishes them, or
// refuses, or records a gap.
func TestPromotionBehindTheStreamIsNotSkippedSilently(t *testing.T) {
	t.Parallel()
	e, pg, sb, svc := promotionEnv(t, false)
	waitSyncedSlot(t, e, sb)
	// What the docs ask for is missing: the primary does not wait for the
	// standby before sending WAL to the capture.
	pgURL := pg.URL(e.slot)
	sbURL := sb.URL(e.slot)
	testExecURL(t, pgURL, `ALTER SYSTEM SET synchronized_standby_slots = ''`)
	testExecURL(t, pgURL, `SELECT pg_reload_conf()`)
	require.NoError(t, sb.Stop())
	// WAL the standby never receives, then a delete the capture publishes.
	testExecURL(t, pgURL, `CREATE TABLE pad (id int, v text); INSERT INTO pad SELECT g, repeat('x', 100) FROM generate_series(1, 2000) g`)
	testExecURL(t, pgURL, `DELETE FROM items WHERE id = 6`)
	require.Len(t, e.deletes(t, "main", 6), 6)
	require.NoError(t, svc.Stop(context.Background()))
	_ = svc.Wait()
	require.NoError(t, pg.Kill())

	require.NoError(t, sb.Start())
	require.NoError(t, sb.Promote())
	require.Equal(t, "1", queryString(t, sbURL, `SELECT count(*)::text FROM items WHERE id = 6`), "the old timeline's delete never reached the new primary")
	// A delete on the new timeline, at a position the stream already passed.
	testExecURL(t, sbURL, `DELETE FROM items WHERE id = 7`)
	deleted7, err := event.ParseLSN(queryString(t, sbURL, `SELECT pg_current_wal_lsn()::text`))
	require.NoError(t, err)
	all := e.messages(t, "main", 0)
	last, err := parsePosition(all[len(all)-1].pos)
	require.Less(t, deleted7, last.lsn, "the new timeline's delete lies before the stream's last position")
	require.NoError(t, err)
	// The new primary's WAL moves past the stream's last position.
	deadline := time.Now().Add(60 * time.Second)
	for {
		cur, err := event.ParseLSN(queryString(t, sbURL, `SELECT pg_current_wal_lsn()::text`))
		require.NoError(t, err)
		if cur > last.lsn {
			break
		}
		require.True(t, time.Now().Before(deadline))
		testExecURL(t, sbURL, `CREATE TABLE IF NOT EXISTS pad2 (id int); INSERT INTO pad2 VALUES (1); SELECT pg_switch_wal()`)
	}

	err = e.startErr(t, nil)
	requireFix(t, err, "timeline", "before the stream's last position", "--recreate-slot")

	e.start(t, func(c *Config) { c.RecreateSlot = true })
	testExecURL(t, sbURL, `INSERT INTO items VALUES (11, 'v11'); DELETE FROM items WHERE id = 11`)
	deadline = time.Now().Add(60 * time.Second)
	for {
		ms := e.messages(t, "main", 0)
		var gaps []msg
		sentinel := false
		for _, m := range ms[len(all):] {
			switch m.ev.Op {
			case event.OpGap:
				gaps = append(gaps, m)
			case event.OpDelete:
				require.JSONEq(t, `{"id":11,"v":"v11"}`, string(m.ev.Row))
				sentinel = true
			}
		}
		if sentinel {
			require.Len(t, gaps, 4, "a gap on every partition")
			for _, g := range gaps {
				require.LessOrEqual(t, g.ev.FromLSN, deleted7, "the gap covers the new timeline's delete of id 7")
				require.GreaterOrEqual(t, g.ev.ToLSN, last.lsn)
				require.Contains(t, g.ev.Reason, "timeline")
			}
			return
		}
		require.True(t, time.Now().Before(deadline), "the sentinel delete never reached the stream")
		time.Sleep(100 * time.Millisecond)
	}
}

func testExecURL(t *testing.T, url, sql string) {
	t.Helper()
	e := &env{db: url}
	e.exec(t, sql)
}

// TestTimelineEndReadsTheHistoryFile: where a timeline ends, from the
// history file TIMELINE_HISTORY returns.
func TestTimelineEndReadsTheHistoryFile(t *testing.T) {
	t.Parallel()
	h := []byte("1\t0/3000158\tno recovery target specified\n\n2\t0/5000A28\tno recovery target specified\n")
	for _, c := range []struct {
		tli  int32
		end  event.LSN
		okay bool
	}{{1, 0x3000158, true}, {2, 0x5000A28, true}, {3, 0, false}, {0, 0, false}} {
		end, ok := timelineEnd(h, c.tli)
		require.Equal(t, c.okay, ok, "timeline %d", c.tli)
		require.Equal(t, c.end, end, "timeline %d", c.tli)
	}
}
