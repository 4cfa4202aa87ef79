package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	capturepkg "github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// corpusTable is one table of the regression database as the corpus run
// sees it: a leaf ("ONLY" for inheritance parents), grouped under the name
// the stream uses (the partition root).
type corpusTable struct {
	name        string   // sanitized, schema-qualified
	streamAs    string   // schema.table of its events: the partition root, or itself
	rows        []string // before the deletes
	gone        []string // what the deletes removed, read in their transactions
	pendingGone []string
	blurred     bool // another table's trigger updated and deleted its rows
	pendingBlur bool
	left        int64  // rows still there after the deletes
	reason      string // why it is not compared, or why it differs
}

// TestRegressionCorpus runs PostgreSQL's own regression suite (its
// parallel schedule, from Debian's source package) against a source the
// real capture binary streams from, with the real projector archiving;
// then it deletes every row of every table (ordinary DELETEs, table by
// table, a foreign key's failure retried after the others), waits for the
// archive, restores every archived transaction into a copy of the schema
// (pg_dump --schema-only) and compares each table by row text. It prints a
// summary; it fails when a process exits on its own, when a published
// table's deleted rows are not all archived, or when a restored table
// differs. make test-corpus fetches the suite and runs it
// (EPITAPH_CORPUS_REGRESS: the suite's src/test/regress; EPITAPH_PG_REGRESS:
// the pg_regress binary).
func TestRegressionCorpus(t *testing.T) {
	dir, pgRegress := os.Getenv("EPITAPH_CORPUS_REGRESS"), os.Getenv("EPITAPH_PG_REGRESS")
	if dir == "" || pgRegress == "" {
		t.Skip("make test-corpus runs it (EPITAPH_CORPUS_REGRESS, EPITAPH_PG_REGRESS)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 80*time.Minute)
	defer cancel()
	bins := binaries(t)
	pg := testenv.NewPostgres(t)
	corpusDatabases(t, pg)
	src, copyURL, target := pg.URL("regression"), pg.URL("regression_copy"), pg.URL("epitaph")

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	const slot = "epitaph_corpus"
	cenv := joinEnv(bench.CaptureEnv(src, "", listen, dataDir, metrics, "main", slot),
		"EPITAPH_TABLES=", "EPITAPH_SET_REPLICA_IDENTITY_FULL=true", "EPITAPH_CATALOG_POLL=1s", "EPITAPH_HEARTBEAT_INTERVAL=1s")
	capture := supervise(t, "capture", bins["capture"], cenv, 1)
	projectorCreds := broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
	creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
	require.NoError(t, err)
	watch, err := bench.WatchStream(natsURL, "main", creds)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, src, slot, captureReadyTimeout, nil))
	workers := superviseProjectors(t, bins["projector"], target, natsURL, 1, 1, "EPITAPH_NATS_CREDS="+projectorCreds)

	runRegressSuite(ctx, t, pg, dir, pgRegress)

	conn, err := pgx.Connect(ctx, src)
	require.NoError(t, err)
	defer conn.Close(ctx)
	// Every table the capture may publish has been seen by its poll.
	time.Sleep(5 * time.Second)
	c := &corpus{t: t, ctx: ctx, conn: conn, tables: corpusTables(ctx, t, conn), byName: map[string]*corpusTable{}, published: map[string]bool{}}
	for _, tb := range c.tables {
		c.byName[tb.name] = tb
	}
	rows, err := conn.Query(ctx, `SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1`, slot)
	require.NoError(t, err)
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	for _, n := range names {
		c.published[n] = true
	}

	total := c.snapshot()
	// The deletes from here on are the ones restored; the suite's own
	// deletes are archived too, and left alone.
	var from string
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&from))
	c.deleteAll()
	deleted, expected := c.expected()
	t.Logf("tables: %d, rows: %d, deleted: %d, published tables: %d", len(c.tables), total, deleted, len(c.published))

	tconn, err := pgx.Connect(ctx, target)
	require.NoError(t, err)
	defer tconn.Close(ctx)
	got, want, short := waitCorpusArchived(ctx, tconn, from, expected)
	t.Logf("archived: %d of the %d rows deleted from published tables", got, want)

	loadSchemaCopy(ctx, t, pg, src, copyURL)
	cannot := restoreAll(ctx, t, bins["projector"], tconn, target, copyURL, from)

	cconn, err := pgx.Connect(ctx, copyURL)
	require.NoError(t, err)
	defer cconn.Close(ctx)
	r := c.compare(cconn, cannot)
	t.Logf("CORPUS: %d tables with rows, %d rows, %d deleted; %d archived of %d deleted from published tables; %d tables restored and compared: %d equal (%d rows), %d differ; %d not compared",
		countWithRows(c.tables), total, deleted, got, want, r.compared, r.equal, r.equalRows, len(r.mismatches), len(r.notCompared))
	for _, m := range r.mismatches {
		t.Logf("  DIFFERS %s", m)
	}
	for _, m := range r.notCompared {
		t.Logf("  not compared: %s", m)
	}
	for _, s := range append([]*supervised{capture}, workers...) {
		t.Logf("%s", s.Stats())
		require.Zero(t, s.selfExit, "%s exited on its own:\n%s", s.name, s.logTail(20))
	}
	require.Empty(t, short, "deleted rows of published tables missing from the archive")
	require.Equal(t, r.compared, r.equal, "restored tables that differ")
}

// corpusDatabases makes the source, its schema copy and the target, the
// first two with the settings pg_regress gives the databases it makes.
func corpusDatabases(t *testing.T, pg *testenv.Postgres) {
	admin := pg.URL("postgres")
	for _, sql := range []string{
		`CREATE DATABASE regression TEMPLATE template0`,
		`CREATE DATABASE regression_copy TEMPLATE template0`,
		`CREATE DATABASE epitaph`,
	} {
		testenv.Exec(t, admin, sql)
	}
	for _, db := range []string{"regression", "regression_copy"} {
		testenv.Exec(t, admin, `ALTER DATABASE `+db+` SET lc_messages TO 'C'; ALTER DATABASE `+db+` SET lc_monetary TO 'C';
			ALTER DATABASE `+db+` SET lc_numeric TO 'C'; ALTER DATABASE `+db+` SET lc_time TO 'C';
			ALTER DATABASE `+db+` SET bytea_output TO 'hex'; ALTER DATABASE `+db+` SET timezone_abbreviations TO 'Default';
			ALTER DATABASE `+db+` SET datestyle TO 'Postgres, MDY'; ALTER DATABASE `+db+` SET timezone TO 'PST8PDT';
			ALTER DATABASE `+db+` SET intervalstyle TO 'postgres_verbose'`)
	}
}

// runRegressSuite runs the suite's parallel schedule on database
// regression while the capture streams. Its own checks fail where a test
// needs the regress.so it ships as C source: its expected output is not
// the point, the tables it leaves are.
func runRegressSuite(ctx context.Context, t *testing.T, pg *testenv.Postgres, dir, pgRegress string) {
	began := time.Now()
	out := t.TempDir()
	sctx, cancel := context.WithTimeout(ctx, 40*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(sctx, pgRegress, "--use-existing", "--host=127.0.0.1", fmt.Sprintf("--port=%d", pg.Port),
		"--user=postgres", "--dbname=regression", "--inputdir="+dir, "--outputdir="+out, "--bindir="+pg.BinDir,
		"--dlpath="+out, "--schedule="+filepath.Join(dir, "parallel_schedule"), "--max-connections=20")
	cmd.Env = append(os.Environ(), "PGOPTIONS=-c statement_timeout=300s")
	res, err := cmd.CombinedOutput()
	var summary string
	for _, l := range strings.Split(string(res), "\n") {
		if strings.Contains(l, "tests") && (strings.Contains(l, "failed") || strings.Contains(l, "passed")) {
			summary = strings.TrimSpace(strings.Trim(l, "= "))
		}
	}
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("pg_regress: %v\n%s", err, tail(string(res), 40))
	}
	t.Logf("regression suite: %s (%s)", summary, time.Since(began).Round(time.Second))
	require.NotEmpty(t, summary, "pg_regress ran no schedule:\n%s", tail(string(res), 40))
}

// corpus is the regression database's tables through the delete phase.
type corpus struct {
	t         *testing.T
	ctx       context.Context
	conn      *pgx.Conn
	tables    []*corpusTable
	byName    map[string]*corpusTable
	published map[string]bool // stream names
}

// snapshot reads every table's rows before the deletes.
func (c *corpus) snapshot() (total int64) {
	for _, tb := range c.tables {
		var err error
		if tb.rows, err = rowTexts(c.ctx, c.conn, tb.name); err != nil {
			tb.reason = "not readable: " + err.Error()
			continue
		}
		total += int64(len(tb.rows))
	}
	return total
}

// readAlong names the tables a DELETE from tb can remove rows from: tb,
// the tables its foreign keys cascade into, and every table when tb has a
// trigger or a rule.
func (c *corpus) readAlong(tb *corpusTable) ([]string, error) {
	var acts bool
	if err := c.conn.QueryRow(c.ctx, `SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = $1::regclass AND NOT tgisinternal)
		OR EXISTS (SELECT 1 FROM pg_rewrite WHERE ev_class = $1::regclass AND rulename <> '_RETURN')`, tb.name).Scan(&acts); err != nil {
		return nil, err
	}
	if acts {
		var names []string
		for _, o := range c.tables {
			if o.reason == "" {
				names = append(names, o.name)
			}
		}
		return names, nil
	}
	rows, err := c.conn.Query(c.ctx, `
WITH RECURSIVE fk(rel) AS (
  SELECT $1::regclass::oid
  UNION SELECT c.conrelid FROM pg_constraint c JOIN fk ON c.confrelid = fk.rel WHERE c.contype = 'f' AND c.confdeltype = 'c')
SELECT DISTINCT format('%I.%I', n.nspname, r.relname)
FROM fk, LATERAL (SELECT fk.rel AS relid UNION SELECT relid FROM pg_partition_tree(fk.rel)) l
JOIN pg_class r ON r.oid = l.relid JOIN pg_namespace n ON n.oid = r.relnamespace WHERE r.relkind = 'r'`, tb.name)
	if err != nil {
		return nil, err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	if !slices.Contains(names, tb.name) {
		names = append(names, tb.name)
	}
	return names, nil
}

// deleteOne deletes every row of tb in one transaction that reads, from
// every table it can remove rows from, the rows it removes.
func (c *corpus) deleteOne(tb *corpusTable) error {
	names, err := c.readAlong(tb)
	if err != nil {
		return err
	}
	return pgx.BeginFunc(c.ctx, c.conn, func(tx pgx.Tx) error {
		before := map[string][]string{}
		for _, n := range names {
			if c.byName[n] == nil {
				continue
			}
			if before[n], err = rowTexts(c.ctx, tx.Conn(), n); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(c.ctx, `DELETE FROM ONLY `+tb.name); err != nil {
			return err
		}
		for n, b := range before {
			after, err := rowTexts(c.ctx, tx.Conn(), n)
			if err != nil {
				return err
			}
			gone := minus(b, after)
			if n != tb.name && len(gone) != len(b)-len(after) {
				// Changed by a trigger or rule too: what was deleted is
				// not told by the rows' text.
				c.byName[n].pendingBlur = true
			}
			c.byName[n].pendingGone = append(c.byName[n].pendingGone, gone...)
		}
		return nil
	})
}

// deleteAll deletes every row of every table, table by table, in rounds:
// a table a foreign key keeps is tried again after the others, one a rule
// or trigger filled again is emptied again.
func (c *corpus) deleteAll() {
	for round := 0; round < 30; round++ {
		progress := false
		for _, tb := range c.tables {
			if tb.reason != "" {
				continue
			}
			n := c.count(tb)
			if n <= 0 {
				continue
			}
			err := c.deleteOne(tb)
			for _, o := range c.tables {
				if err == nil {
					o.gone = append(o.gone, o.pendingGone...)
					o.blurred = o.blurred || o.pendingBlur
				}
				o.pendingGone, o.pendingBlur = nil, false
			}
			var pgErr *pgconn.PgError
			switch {
			case errors.As(err, &pgErr) && pgErr.Code == "23503":
				// a row of another table refers to it: after that one
			case err != nil:
				tb.reason = "DELETE failed: " + err.Error()
			case c.count(tb) < n:
				progress = true
			}
		}
		if !progress {
			return
		}
	}
}

// count is tb's row count, -1 when it cannot be read.
func (c *corpus) count(tb *corpusTable) int64 {
	var n int64
	if err := c.conn.QueryRow(c.ctx, `SELECT count(*) FROM ONLY `+tb.name).Scan(&n); err != nil {
		return -1
	}
	return n
}

// expected is the number of rows deleted, and per stream name of a
// published table the rows the archive must hold.
func (c *corpus) expected() (deleted int64, expected map[string]int64) {
	expected = map[string]int64{}
	blurred := map[string]bool{}
	for _, tb := range c.tables {
		blurred[tb.streamAs] = blurred[tb.streamAs] || tb.blurred
	}
	for _, tb := range c.tables {
		tb.left = c.count(tb)
		slices.Sort(tb.gone)
		n := int64(len(tb.gone))
		deleted += n
		if c.published[tb.streamAs] && !blurred[tb.streamAs] {
			expected[tb.streamAs] += n
		}
	}
	return deleted, expected
}

// waitCorpusArchived waits (up to 10 minutes) until the archive holds, from
// commit position from on, the expected rows per table; short names the
// tables that fall short.
func waitCorpusArchived(ctx context.Context, tconn *pgx.Conn, from string, expected map[string]int64) (got, want int64, short []string) {
	for _, n := range expected {
		want += n
	}
	archived := map[string]int64{}
	deadline := time.Now().Add(10 * time.Minute)
	for {
		clear(archived)
		var all int64
		rows, err := tconn.Query(ctx, `SELECT schema_name || '.' || table_name, count(*) FROM archive.rows
			WHERE source = 'main' AND commit_lsn > $1::pg_lsn GROUP BY 1`, from)
		if err == nil {
			for rows.Next() {
				var n string
				var c int64
				if rows.Scan(&n, &c) == nil {
					archived[n] = c
					all += c
				}
			}
			rows.Close()
		}
		if all >= want || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Second)
	}
	for n, c := range expected {
		got += min(archived[n], c)
		if archived[n] < c {
			short = append(short, fmt.Sprintf("%s (%d of %d)", n, archived[n], c))
		}
	}
	sort.Strings(short)
	return got, want, short
}

// loadSchemaCopy copies src's schema into copyURL (pg_dump --schema-only;
// what it cannot create shows as a restore failure later). The copy holds
// rows only: its event triggers, user triggers and rules (which add rows
// elsewhere, or refuse them) are off.
func loadSchemaCopy(ctx context.Context, t *testing.T, pg *testenv.Postgres, src, copyURL string) {
	dump := exec.CommandContext(ctx, filepath.Join(pg.BinDir, "pg_dump"), "--schema-only", "--no-publications", "--no-subscriptions", src)
	schema, err := dump.Output()
	require.NoError(t, err, "pg_dump --schema-only")
	load := exec.CommandContext(ctx, filepath.Join(pg.BinDir, "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=0", copyURL)
	load.Stdin = strings.NewReader(string(schema))
	_, _ = load.CombinedOutput()
	testenv.Exec(t, copyURL, `DO $$ DECLARE e text; r record; BEGIN
		FOR e IN SELECT evtname FROM pg_event_trigger LOOP EXECUTE format('DROP EVENT TRIGGER %I', e); END LOOP;
		FOR r IN SELECT DISTINCT tgrelid::regclass AS rel FROM pg_trigger JOIN pg_class c ON c.oid = tgrelid
			WHERE NOT tgisinternal AND c.relkind IN ('r', 'p') LOOP
			EXECUTE format('ALTER TABLE %s DISABLE TRIGGER USER', r.rel); END LOOP;
		FOR r IN SELECT ev_class::regclass AS rel, rulename FROM pg_rewrite JOIN pg_class c ON c.oid = ev_class
			WHERE rulename <> '_RETURN' AND c.relkind IN ('r', 'p') LOOP
			EXECUTE format('ALTER TABLE %s DISABLE RULE %I', r.rel, r.rulename); END LOOP; END $$`)
}

// restoreAll restores every archived transaction from commit position from
// on into copyURL with projector restore, the last deleted first (a
// referenced table's rows before the rows referring to them). cannot says,
// per stream name, why a restore of its rows was refused.
func restoreAll(ctx context.Context, t *testing.T, bin string, tconn *pgx.Conn, target, copyURL, from string) (cannot map[string]string) {
	rows, err := tconn.Query(ctx, `SELECT correlation_id FROM archive.rows WHERE source = 'main' AND commit_lsn > $1::pg_lsn
		GROUP BY 1 ORDER BY max(commit_lsn) DESC`, from)
	require.NoError(t, err)
	corrs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	cannot = map[string]string{}
	refused := 0
	for _, c := range corrs {
		p := exec.CommandContext(ctx, bin, "restore", "--correlation", c, "--source-url", copyURL, "--actor", "corpus")
		p.Env = joinEnv(os.Environ(), "EPITAPH_TARGET_URL="+target, "EPITAPH_SOURCE_NAME=main")
		res, err := p.CombinedOutput()
		if err == nil {
			continue
		}
		refused++
		msg := strings.ReplaceAll(strings.TrimSpace(tail(string(res), 2)), "\n", " ")
		rows, err := tconn.Query(ctx, `SELECT DISTINCT schema_name || '.' || table_name FROM archive.rows WHERE correlation_id = $1`, c)
		require.NoError(t, err)
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		for _, n := range names {
			cannot[n] = "restore refused: " + msg
		}
	}
	t.Logf("restore: %d transactions, %d refused", len(corrs), refused)
	return cannot
}

// corpusResult is the comparison of the restored copy with the deletes.
type corpusResult struct {
	compared, equal         int
	equalRows               int64
	mismatches, notCompared []string
}

// compare reads every table back from the copy and compares it, by row
// text, with what the deletes removed.
func (c *corpus) compare(cconn *pgx.Conn, cannot map[string]string) corpusResult {
	var r corpusResult
	for _, tb := range c.tables {
		switch {
		case tb.reason != "":
		case len(tb.rows) == 0 && len(tb.gone) == 0:
			continue
		case tb.left != 0:
			tb.reason = fmt.Sprintf("%d rows not deleted (a rule or trigger keeps them)", tb.left)
		case !c.published[tb.streamAs]:
			tb.reason = "not published by the capture"
		case cannot[tb.streamAs] != "":
			tb.reason = cannot[tb.streamAs]
		case tb.blurred:
			tb.reason = "another table's trigger or rule changed its rows besides deleting some: what was deleted is not told by row text"
		}
		if tb.reason != "" {
			r.notCompared = append(r.notCompared, fmt.Sprintf("%s: %s", tb.name, tb.reason))
			continue
		}
		r.compared++
		back, err := rowTexts(c.ctx, cconn, tb.name)
		switch {
		case err != nil:
			r.mismatches = append(r.mismatches, fmt.Sprintf("%s: not in the copy: %v", tb.name, err))
		case slices.Equal(back, tb.gone):
			r.equal++
			r.equalRows += int64(len(back))
		default:
			r.mismatches = append(r.mismatches, fmt.Sprintf("%s: %d rows deleted, %d restored, %s", tb.name, len(tb.gone), len(back), firstDiff(tb.gone, back)))
		}
	}
	sort.Strings(r.mismatches)
	sort.Strings(r.notCompared)
	return r
}

// corpusTables lists the regression database's tables with their stream
// names: ordinary tables and partitions (leaves), outside the system and
// Epitaph's schemas, not an extension's, persistent.
func corpusTables(ctx context.Context, t *testing.T, conn *pgx.Conn) []*corpusTable {
	t.Helper()
	rows, err := conn.Query(ctx, `
SELECT format('%I.%I', n.nspname, c.relname),
       (SELECT rn.nspname || '.' || r.relname FROM pg_class r JOIN pg_namespace rn ON rn.oid = r.relnamespace
         WHERE r.oid = COALESCE(pg_partition_root(c.oid), c.oid))
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind = 'r' AND c.relpersistence = 'p'
  AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'epitaph', 'epitaph_capture', 'archive')
  AND n.nspname NOT LIKE 'pg\_%'
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e')
ORDER BY 1`)
	require.NoError(t, err)
	var out []*corpusTable
	for rows.Next() {
		tb := &corpusTable{}
		require.NoError(t, rows.Scan(&tb.name, &tb.streamAs))
		out = append(out, tb)
	}
	require.NoError(t, rows.Err())
	return out
}

func countWithRows(ts []*corpusTable) int {
	n := 0
	for _, t := range ts {
		if len(t.rows) > 0 {
			n++
		}
	}
	return n
}

// rowTexts reads a table's rows (ONLY) as text, sorted: its columns in the
// order of their names (a copy made by pg_dump may order an inheritance
// child's columns differently), NULL as "NULL".
func rowTexts(ctx context.Context, conn *pgx.Conn, table string) ([]string, error) {
	var cols []string
	rows, err := conn.Query(ctx, `SELECT quote_ident(attname) FROM pg_attribute
		WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attname`, table)
	if err == nil {
		cols, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		return nil, err
	}
	expr := "'()'"
	if len(cols) > 0 {
		expr = "COALESCE(ROW(" + strings.Join(cols, ", ") + ")::text, 'NULL')"
	}
	if len(cols) == 1 {
		expr = "COALESCE(" + cols[0] + "::text, 'NULL')"
	}
	rows, err = conn.Query(ctx, `SELECT `+expr+` FROM ONLY `+table)
	if err != nil {
		return nil, err
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	slices.Sort(out)
	return out, err
}

// firstDiff names a row one side has and the other lacks, each way.
// minus is the multiset a - b.
func minus(a, b []string) []string {
	n := map[string]int{}
	for _, r := range b {
		n[r]++
	}
	var out []string
	for _, r := range a {
		if n[r] > 0 {
			n[r]--
			continue
		}
		out = append(out, r)
	}
	return out
}

func firstDiff(want, got []string) string {
	g := map[string]int{}
	for _, r := range got {
		g[r]++
	}
	var missing, extra string
	for _, r := range want {
		if g[r] == 0 && missing == "" {
			missing = "missing " + truncate(r, 100)
		}
		g[r]--
	}
	for r, n := range g {
		if n > 0 {
			extra = "; extra " + truncate(r, 100)
			break
		}
	}
	return missing + extra
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
