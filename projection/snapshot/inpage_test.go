package snapshot_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// randomTx is a random aggregate deleted in one source transaction:
// rows of three tables referencing each other by single and composite
// foreign keys (NULL, dangling, self and cyclic references included),
// values of many JSON shapes, objects with their keys in random order and
// random spacing, root keys deleted twice, and now and then a commit
// counting more rows of a table than were archived (a short group).
func randomTx(rng *rand.Rand, lsn event.LSN) (*event.Event, []snapshot.Row) {
	refs := map[string][]event.Ref{
		"t_root": {{Columns: []string{"parent"}, Schema: "public", Table: "t_root", RefColumns: []string{"id"}}},
		"t_mid": {
			{Columns: []string{"root_id"}, Schema: "public", Table: "t_root", RefColumns: []string{"id"}},
			{Columns: []string{"sib"}, Schema: "public", Table: "t_mid", RefColumns: []string{"id"}},
		},
		"t_leaf": {
			{Columns: []string{"mid_id", "mid_k"}, Schema: "public", Table: "t_mid", RefColumns: []string{"id", "k"}},
			{Columns: []string{"root_id"}, Schema: "public", Table: "t_root", RefColumns: []string{"id"}},
		},
	}
	tables := []string{"t_root", "t_mid", "t_leaf"}
	n := 1 + rng.IntN(25)
	commit := &event.Event{V: event.Version, Op: event.OpCommit, Source: "main", XID: int64(lsn) % 100000,
		CommitLSN: lsn, CommitTime: time.Date(2026, 11, 30, 9, 0, 0, 123456789, time.UTC), Tables: map[string]int{}}
	ref := func(max int) any { // an id that may dangle, or NULL
		if rng.IntN(4) == 0 {
			return nil
		}
		return rng.IntN(max + 2)
	}
	var rows []snapshot.Row
	for seq := range n {
		table := tables[rng.IntN(3)]
		id := rng.IntN(n + 1) // repeats: a key deleted twice
		vals := map[string]any{"id": id}
		switch table {
		case "t_root":
			vals["parent"] = ref(n)
		case "t_mid":
			vals["root_id"], vals["sib"], vals["k"] = ref(n), ref(n), fmt.Sprintf("k%d", id%3)
		case "t_leaf":
			vals["mid_id"], vals["root_id"] = ref(n), ref(n)
			vals["mid_k"] = []any{"k0", "k1", "k2", nil}[rng.IntN(4)]
		}
		extras := []any{"Zoë \"q\" \\ \u2603", 12.5, "12.50", map[string]any{"b": []any{1, "x", nil}, "a": true}, nil,
			strings.Repeat("long ", rng.IntN(50)), "9007199254740993", 9007199254740993, "NaN", []any{}}
		vals["extra"] = extras[rng.IntN(len(extras))]
		key := map[string]any{"id": id}
		rows = append(rows, snapshot.Row{Schema: "public", Table: table, Identity: "full",
			Key: messyJSON(rng, key), Row: messyJSON(rng, vals), Refs: refs[table], Seq: seq,
			CommitTime: commit.CommitTime})
		commit.Tables["public."+table]++
		commit.Rows++
	}
	if rng.IntN(8) == 0 {
		commit.Tables["public.t_mid"]++ // short: a row of it is missing
	}
	return commit, rows
}

// messyJSON encodes an object with its keys in random order and random
// spacing, as another encoder might.
func messyJSON(rng *rand.Rand, obj map[string]any) json.RawMessage {
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
	sp := []string{"", " ", "\n  "}
	var b strings.Builder
	b.WriteString("{" + sp[rng.IntN(3)])
	for i, k := range keys {
		if i > 0 {
			b.WriteString("," + sp[rng.IntN(3)])
		}
		kb, _ := json.Marshal(k)
		vb, _ := json.Marshal(obj[k])
		b.Write(kb)
		b.WriteString(":" + sp[rng.IntN(3)])
		b.Write(vb)
	}
	b.WriteString(sp[rng.IntN(3)] + "}")
	return json.RawMessage(b.String())
}

// insertRows archives rows of a transaction as the projector does, with
// archived_at given (nil: the default now()); it returns the archived_at
// the rows got.
func insertArchive(t *testing.T, ctx context.Context, tx pgx.Tx, schema string, c *event.Event, rows []snapshot.Row, at *time.Time) time.Time {
	t.Helper()
	var got time.Time
	for _, r := range rows {
		refs, err := json.Marshal(r.Refs)
		require.NoError(t, err)
		err = tx.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{schema, "rows"}.Sanitize()+`
			(source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, commit_time, seq, refs, archived_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::pg_lsn, $10, $11, $12, COALESCE($13, now()))
			RETURNING archived_at`,
			c.Source, r.Schema, r.Table, string(r.Key), string(r.Row), r.Identity, c.CorrelationID(), c.XID,
			c.CommitLSN.String(), r.CommitTime, r.Seq, refs, at).Scan(&got)
		require.NoError(t, err)
	}
	return got
}

type jobRow struct {
	Correlation, RootTable, RootKey string
	RootSeq                         int
	Status                          string
	Payload, Fingerprint, Reason    *string
	Retries                         int
	Expected                        string
	ExpectedRows                    int
}

func jobsOf(t *testing.T, e *env, schema string) []jobRow {
	t.Helper()
	rows, err := e.pool.Query(e.ctx, `SELECT correlation_id, root_table, root_key::text, root_seq, status, payload::text,
		fingerprint, failure_reason, retry_count, expected_tables::text, expected_rows
		FROM `+pgx.Identifier{schema, "snapshots"}.Sanitize()+` ORDER BY correlation_id, root_table, root_key::text`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (jobRow, error) {
		var j jobRow
		return j, r.Scan(&j.Correlation, &j.RootTable, &j.RootKey, &j.RootSeq, &j.Status, &j.Payload,
			&j.Fingerprint, &j.Reason, &j.Retries, &j.Expected, &j.ExpectedRows)
	})
	require.NoError(t, err)
	return out
}

// The property behind in-page assembly: for random aggregates, the jobs
// CreateAssembled writes in the archiving transaction are exactly (status,
// payload as stored, fingerprint, root, retries, reason, counts) what
// CreateJobs and a batch make from the same archive rows; complete groups
// are complete when that transaction commits, short ones are left pending
// for the batcher and then end as the batch has them.
func TestInPageAssemblyEqualsTheBatch(t *testing.T) {
	t.Parallel()
	e := setup(t)
	testenv.Exec(t, e.url, fmt.Sprintf(archiveRowsDDL, "archive_v2"))
	require.NoError(t, snapshot.Migrate(e.ctx, e.pool, "archive_v2"))
	roots := []string{"public.t_root", "public.t_leaf"}
	rng := rand.New(rand.NewPCG(19, 2026))
	clock := func() time.Time { return time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC) }
	cfg := snapshot.Config{BatchSize: 3, MaxAttempts: 3, RetryDelay: time.Hour, MaxRetryDelay: time.Hour, Clock: clock}

	complete, short, docs := 0, 0, 0
	lsn := event.LSN(0x5000000)
	for round := range 40 {
		// Several transactions applied by one target transaction.
		var groups []snapshot.Group
		a, err := e.pool.Begin(e.ctx)
		require.NoError(t, err)
		for range 1 + rng.IntN(3) {
			lsn += 0x100
			c, rows := randomTx(rng, lsn)
			at := insertArchive(t, e.ctx, a, "archive_v1", c, rows, nil)
			groups = append(groups, snapshot.Group{Commit: c, Rows: rows, ArchivedAt: at})
		}
		created, pending, err := snapshot.CreateAssembled(e.ctx, a, "archive_v1", groups, roots)
		require.NoError(t, err)
		require.NoError(t, a.Commit(e.ctx))

		// The same rows (with the same archived_at) through CreateJobs
		// and the batch, in version 2.
		b, err := e.pool.Begin(e.ctx)
		require.NoError(t, err)
		want := 0
		for _, g := range groups {
			insertArchive(t, e.ctx, b, "archive_v2", g.Commit, g.Rows, &g.ArchivedAt)
			n, err := snapshot.CreateJobs(e.ctx, b, "archive_v2", g.Commit, roots)
			require.NoError(t, err)
			want += n
		}
		require.NoError(t, b.Commit(e.ctx))
		require.Equal(t, want, created, "round %d: one job per root key", round)

		// Right after the apply: a complete group is complete, a short
		// one pending and untried.
		for _, g := range groups {
			list, err := snapshot.Show(e.ctx, e.pool, "archive_v1", g.Commit.CorrelationID())
			require.NoError(t, err)
			isShort := false
			for tbl, n := range g.Commit.Tables {
				have := 0
				for _, r := range g.Rows {
					if r.Schema+"."+r.Table == tbl {
						have++
					}
				}
				isShort = isShort || have < n
			}
			for _, s := range list {
				if isShort {
					require.Equal(t, snapshot.StatusPending, s.Status, "round %d", round)
					require.Zero(t, s.RetryCount)
				} else {
					require.Equal(t, snapshot.StatusComplete, s.Status, "round %d: %s", round, s.FailureReason)
					require.NotNil(t, s.CompletedAt)
					docs++
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
		np := 0
		for _, j := range jobsOf(t, e, "archive_v1") {
			if j.Status == snapshot.StatusPending && j.Retries == 0 {
				np++
			}
		}
		require.Equal(t, np, pending, "round %d: pending jobs reported", round)

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
	var groupsA, groupsB []string
	for schema, out := range map[string]*[]string{"archive_v1": &groupsA, "archive_v2": &groupsB} {
		rows, err := e.pool.Query(e.ctx, `SELECT correlation_id || ' ' || roots::text || ' ' || expected_tables::text || ' ' || expected_rows
			FROM `+pgx.Identifier{schema, "snapshot_groups"}.Sanitize()+` ORDER BY 1`)
		require.NoError(t, err)
		*out, err = pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
	}
	require.Equal(t, groupsB, groupsA, "the groups recorded for late rows")
	require.NotEmpty(t, groupsA)
	// The random cases covered both paths.
	require.Greater(t, complete, 20)
	require.Greater(t, short, 2)
	require.Greater(t, docs, 50)
}

// A transaction that is not the whole group (fewer rows than the commit
// says, or a seq out of range) is never assembled in page: it gets a
// pending job, as CreateJobs makes it.
func TestInPageAssemblyRefusesAnIncompleteGroup(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 1)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	require.NoError(t, s.tx.Commit(e.ctx))
	var rows []snapshot.Row
	for _, a := range s.rows[1:] { // a note is not there
		rows = append(rows, snapshot.Row{Schema: a.Schema, Table: a.Name, Identity: "full", Key: a.Key, Row: a.Row,
			Refs: a.Refs, Seq: a.Seq, CommitTime: s.commit.CommitTime})
	}
	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	s.archive(t, tx, s.rows[1:])
	created, pending, err := snapshot.CreateAssembled(e.ctx, tx, e.schema,
		[]snapshot.Group{{Commit: &s.commit, Rows: rows, ArchivedAt: time.Now()}}, orderRoots)
	require.NoError(t, err)
	require.Equal(t, 1, created)
	require.Equal(t, 1, pending)
	require.NoError(t, tx.Commit(e.ctx))
	got := e.show(t, s.correlationID())[`{"id":1}`]
	require.Equal(t, snapshot.StatusPending, got.Status)
	require.Nil(t, got.Payload)

	_, _, err = snapshot.CreateAssembled(e.ctx, nil, e.schema, []snapshot.Group{{Commit: &event.Event{Op: event.OpDelete}}}, orderRoots)
	require.ErrorContains(t, err, "not a commit event")
}

// Documents are stored lz4-compressed: a new snapshots table says so, and
// Migrate switches a version made before (pglz) for its new documents,
// once, while the documents it stored before stay readable as they are.
func TestPayloadsCompressWithLZ4(t *testing.T) {
	t.Parallel()
	e := setup(t)
	method := func() string {
		var m string
		require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT attcompression::text FROM pg_attribute
			WHERE attrelid = 'archive_v1.snapshots'::regclass AND attname = 'payload'`).Scan(&m))
		return m
	}
	require.Equal(t, "l", method())
	testenv.Exec(t, e.url, `ALTER TABLE archive_v1.snapshots ALTER COLUMN payload SET COMPRESSION pglz`)
	require.Equal(t, "p", method())

	// Order 1 in page, before Migrate: pglz.
	e.seedOrder(t, 1, 2)
	s1 := e.begin(t)
	s1.deleteOrder(t, 1)
	require.NoError(t, s1.tx.Commit(e.ctx))
	var rows []snapshot.Row
	for _, a := range s1.rows {
		rows = append(rows, snapshot.Row{Schema: a.Schema, Table: a.Name, Identity: "full", Key: a.Key, Row: a.Row,
			Refs: a.Refs, Seq: a.Seq, CommitTime: s1.commit.CommitTime})
	}
	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	s1.archive(t, tx, s1.rows)
	_, pending, err := snapshot.CreateAssembled(e.ctx, tx, e.schema,
		[]snapshot.Group{{Commit: &s1.commit, Rows: rows, ArchivedAt: time.Now()}}, orderRoots)
	require.NoError(t, err)
	require.Zero(t, pending)
	require.NoError(t, tx.Commit(e.ctx))

	// Migrate (every start does): lz4 from now on, and only once.
	require.NoError(t, snapshot.Migrate(e.ctx, e.pool, e.schema))
	require.Equal(t, "l", method())
	require.NoError(t, snapshot.Migrate(e.ctx, e.pool, e.schema))
	require.Equal(t, "l", method())

	// Order 2 through the batch.
	e.seedOrder(t, 2, 2)
	s2 := e.begin(t)
	s2.deleteOrder(t, 2)
	require.Equal(t, 1, s2.apply(t, orderRoots))
	require.Equal(t, 1, e.batch(t, snapshot.Config{}).Completed)

	got := map[int]string{}
	r, err := e.pool.Query(e.ctx, `SELECT (root_key->>'id')::int, pg_column_compression(payload),
		length(payload->'root'->'row'->>'note') FROM archive_v1.snapshots WHERE status = 'complete'`)
	require.NoError(t, err)
	for r.Next() {
		var id, n int
		var m string
		require.NoError(t, r.Scan(&id, &m, &n))
		require.Equal(t, 25000, n, "order %d: the note as deleted", id)
		got[id] = m
	}
	require.NoError(t, r.Err())
	require.Equal(t, map[int]string{1: "pglz", 2: "lz4"}, got)
	for id, s := range map[int]*sourceTx{1: s1, 2: s2} {
		d := decodeDoc(t, e.show(t, s.correlationID())[fmt.Sprintf(`{"id":%d}`, id)])
		require.Equal(t, 7, d.Meta.EntityCount, "order %d", id)
	}
}
