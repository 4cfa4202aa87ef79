package snapshot_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// The property behind assembly from the archive (transactions spanning
// pages): for random aggregates whose rows were archived partly by an
// earlier transaction (an earlier page) and partly by the one that applies
// the commit, the jobs CreateFromArchive writes in that transaction are
// exactly (status, payload as stored, fingerprint, root, retries, reason,
// counts) what CreateJobs and a batch make from the same archive rows.
// Complete groups are complete when that transaction commits; short ones
// (a row the commit counted is missing, or not archived yet) are left
// pending for the batcher. Applied again (a replayed commit) it creates
// nothing and hands the existing documents to a batch.
func TestArchiveAssemblyEqualsTheBatch(t *testing.T) {
	t.Parallel()
	e := setup(t)
	testenv.Exec(t, e.url, fmt.Sprintf(archiveRowsDDL, "archive_v2"))
	require.NoError(t, snapshot.Migrate(e.ctx, e.pool, "archive_v2"))
	roots := []string{"public.t_root", "public.t_leaf"}
	rng := rand.New(rand.NewPCG(23, 2026))
	clock := func() time.Time { return time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC) }
	cfg := snapshot.Config{BatchSize: 3, MaxAttempts: 3, RetryDelay: time.Hour, MaxRetryDelay: time.Hour, Clock: clock}

	type part struct {
		rows []snapshot.Row
		at   time.Time
	}
	complete, short, docs := 0, 0, 0
	lsn := event.LSN(0x7000000)
	for round := range 40 {
		var commits []*event.Event
		parts := map[*event.Event][2]part{}
		// The earlier page: the first rows of each transaction.
		early, err := e.pool.Begin(e.ctx)
		require.NoError(t, err)
		for range 1 + rng.IntN(3) {
			lsn += 0x100
			c, rows := randomTx(rng, lsn)
			if rng.IntN(8) == 0 {
				i := rng.IntN(len(rows)) // not archived (yet)
				rows = append(rows[:i:i], rows[i+1:]...)
			}
			split := rng.IntN(len(rows) + 1)
			var p [2]part
			p[0].rows, p[1].rows = rows[:split], rows[split:]
			p[0].at = insertArchive(t, e.ctx, early, "archive_v1", c, p[0].rows, nil)
			commits, parts[c] = append(commits, c), p
		}
		require.NoError(t, early.Commit(e.ctx))
		// The page that applies the commits: the other rows, then the
		// documents.
		a, err := e.pool.Begin(e.ctx)
		require.NoError(t, err)
		for _, c := range commits {
			p := parts[c]
			p[1].at = insertArchive(t, e.ctx, a, "archive_v1", c, p[1].rows, nil)
			parts[c] = p
		}
		created, pending, err := snapshot.CreateFromArchive(e.ctx, a, "archive_v1", commits, roots)
		require.NoError(t, err)
		require.NoError(t, a.Commit(e.ctx))

		// The same rows (with the same archived_at) through CreateJobs
		// and the batch, in version 2.
		b, err := e.pool.Begin(e.ctx)
		require.NoError(t, err)
		want := 0
		for _, c := range commits {
			for _, p := range parts[c] {
				insertArchive(t, e.ctx, b, "archive_v2", c, p.rows, &p.at)
			}
			n, err := snapshot.CreateJobs(e.ctx, b, "archive_v2", c, roots)
			require.NoError(t, err)
			want += n
		}
		require.NoError(t, b.Commit(e.ctx))
		require.Equal(t, want, created, "round %d: one job per root key", round)

		// Right after the apply: a complete group is complete, a short
		// one pending and untried.
		np, assembled := 0, 0
		for _, c := range commits {
			list, err := snapshot.Show(e.ctx, e.pool, "archive_v1", c.CorrelationID())
			require.NoError(t, err)
			have := map[string]int{}
			for _, p := range parts[c] {
				for _, r := range p.rows {
					have[r.Schema+"."+r.Table]++
				}
			}
			isShort := false
			for tbl, n := range c.Tables {
				isShort = isShort || have[tbl] < n
			}
			for _, s := range list {
				if isShort {
					require.Equal(t, snapshot.StatusPending, s.Status, "round %d", round)
					require.Zero(t, s.RetryCount)
					np++
				} else {
					require.Equal(t, snapshot.StatusComplete, s.Status, "round %d: %s", round, s.FailureReason)
					require.NotNil(t, s.CompletedAt)
					docs++
					assembled++
				}
			}
			if len(list) > 0 {
				if isShort {
					short++
				} else {
					complete++
				}
			}
		}
		require.Equal(t, np, pending, "round %d: pending jobs reported", round)

		// A replayed commit: nothing new, the documents there handed on.
		before := jobsOf(t, e, "archive_v1")
		r, err := e.pool.Begin(e.ctx)
		require.NoError(t, err)
		created, pending, err = snapshot.CreateFromArchive(e.ctx, r, "archive_v1", commits, roots)
		require.NoError(t, err)
		require.NoError(t, r.Commit(e.ctx))
		require.Zero(t, created, "round %d", round)
		require.Equal(t, assembled, pending, "round %d: the documents already there", round)
		require.Equal(t, before, jobsOf(t, e, "archive_v1"), "round %d", round)

		for _, schema := range []string{"archive_v1", "archive_v2"} {
			c := cfg
			c.Schema = schema
			for {
				res, err := snapshot.RunBatch(e.ctx, e.pool, c)
				require.NoError(t, err)
				if res.Claimed == 0 {
					break
				}
			}
		}
		require.Equal(t, jobsOf(t, e, "archive_v2"), jobsOf(t, e, "archive_v1"), "round %d", round)
	}
	// The random cases covered both outcomes.
	require.Greater(t, complete, 20)
	require.Greater(t, short, 2)
	require.Greater(t, docs, 50)

	_, _, err := snapshot.CreateFromArchive(e.ctx, nil, e.schema, []*event.Event{{Op: event.OpDelete}}, roots)
	require.ErrorContains(t, err, "not a commit event")
}
