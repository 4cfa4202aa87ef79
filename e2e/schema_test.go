package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// deletedRow is one row the migration workload deleted, as the source had
// it (to_jsonb of the row at the DELETE).
type deletedRow struct {
	table string // as the archive names it: the partitioned root for a leaf's row
	id    int64
	row   json.RawMessage
	// dropped: the table is dropped later in the workload; a table
	// created and dropped while the capture was down has no recorded
	// keys, and a FULL table's Relation message flags every column, so
	// the row may come without a key, never with a wrong one.
	dropped bool
}

// migrationLedger records the deleted rows.
type migrationLedger struct {
	mu   sync.Mutex
	rows []deletedRow
}

func (l *migrationLedger) deleteReturning(ctx context.Context, tx pgx.Tx, archived, sql string, dropped bool) error {
	rows, err := tx.Query(ctx, sql)
	if err != nil {
		return err
	}
	var got []deletedRow
	for rows.Next() {
		var d deletedRow
		if err := rows.Scan(&d.id, &d.row); err != nil {
			rows.Close()
			return err
		}
		d.table, d.dropped = archived, dropped
		got = append(got, d)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	l.mu.Lock()
	l.rows = append(l.rows, got...)
	l.mu.Unlock()
	return nil
}

// TestMigrationsUnderKills runs a migration-style workload — tables
// created, columns added and dropped, a primary key replaced in two steps,
// partitioned tables with partitions added later, tables dropped right
// after their last deletes — while the capture (with
// --set-replica-identity-full and a 200ms catalog poll, every table) and a
// projector run against one database, the capture SIGKILLed and restarted
// at random points. The application waits, as the README says, until a
// table it just created is published (and FULL) before deleting from it.
// At the end archive.rows holds every deleted row exactly once, each value
// equal to what the source had, identity full.
func TestMigrationsUnderKills(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 12))

	url := testenv.NewDatabase(t) // source and target
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, `CREATE TABLE base (id bigint PRIMARY KEY, v text); INSERT INTO base SELECT g, 'b' || g FROM generate_series(1, 100) g`)
	require.NoError(t, err)

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	dataDir := t.TempDir() // the embedded broker's credentials: <dataDir>/nats
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	cenv := joinEnv(bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_schema"),
		"EPITAPH_TABLES=", "EPITAPH_SET_REPLICA_IDENTITY_FULL=true", "EPITAPH_CATALOG_POLL=200ms", "EPITAPH_HEARTBEAT_INTERVAL=1s")
	capture := supervise(t, "capture", bins["capture"], cenv, seed)
	watch, err := bench.WatchStream(natsURL, "main", bench.EmbeddedCreds(dataDir))
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_schema", captureReadyTimeout, nil))
	m, err := bench.LocalAddr()
	require.NoError(t, err)
	projector := supervise(t, "projector", bins["projector"], joinEnv(bench.ProjectorEnv(url, natsURL, m, "main", "worker-0"), "EPITAPH_LEASE_TTL=3s",
		"EPITAPH_NATS_CREDS="+filepath.Join(dataDir, "nats", "projector.creds")), seed+1, "run")

	// waitReady polls until every relation of the table (the table or its
	// leaves) is REPLICA IDENTITY FULL and the table is published.
	waitReady := func(table string) error {
		return workload.WaitFor(ctx, 2*time.Minute, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
			n, err := bench.Count(ctx, url, `
				SELECT count(*) FROM pg_class c
				WHERE (c.oid = $1::regclass OR c.oid IN (SELECT relid FROM pg_partition_tree($1::regclass)))
				  AND c.relkind IN ('r', 'p') AND c.relreplident <> 'f'`, table)
			if err != nil || n > 0 {
				return false, err
			}
			p, err := bench.Count(ctx, url, `SELECT count(*) FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
				WHERE p.pubname = 'epitaph_e2e_schema' AND pr.prrelid = $1::regclass`, table)
			return p == 1, err
		})
	}
	var ledger migrationLedger
	inTx := func(f func(tx pgx.Tx) error) error { return pgx.BeginFunc(ctx, conn, f) }
	exec := func(sql string) error { _, err := conn.Exec(ctx, sql); return err }
	del := func(archived, from, where string, dropAfter bool) error {
		return inTx(func(tx pgx.Tx) error {
			sql := fmt.Sprintf(`DELETE FROM %s t WHERE %s RETURNING id, to_jsonb(t)`, from, where)
			if err := ledger.deleteReturning(ctx, tx, archived, sql, dropAfter); err != nil {
				return err
			}
			if dropAfter {
				_, err := tx.Exec(ctx, "DROP TABLE "+from)
				return err
			}
			return nil
		})
	}
	const rounds = 6
	workloadDone := make(chan error, 1)
	go func() {
		workloadDone <- func() error {
			for i := range rounds {
				mt, pt := fmt.Sprintf("m_%d", i), fmt.Sprintf("p_%d", i)
				steps := []func() error{
					func() error {
						return exec(fmt.Sprintf(`CREATE TABLE %[1]s (id bigint PRIMARY KEY, v text); INSERT INTO %[1]s SELECT g, 'v' || g FROM generate_series(1, 60) g`, mt))
					},
					func() error { return waitReady(mt) },
					func() error { return del("public."+mt, mt, "id <= 10", false) },
					func() error { return exec(fmt.Sprintf(`ALTER TABLE %s ADD COLUMN w int DEFAULT %d`, mt, i)) },
					func() error { return del("public."+mt, mt, "id <= 20", false) },
					func() error { return exec(fmt.Sprintf(`ALTER TABLE %s DROP COLUMN v`, mt)) },
					func() error { return del("public."+mt, mt, "id <= 30", false) },
					// A key replaced in two steps (the table is FULL: still safe).
					func() error {
						return exec(fmt.Sprintf(`ALTER TABLE %[1]s DROP CONSTRAINT %[1]s_pkey; ALTER TABLE %[1]s ADD PRIMARY KEY (id)`, mt))
					},
					func() error { return del("public."+mt, mt, "id <= 40", false) },
					func() error {
						return exec(fmt.Sprintf(`CREATE TABLE %[1]s (id bigint PRIMARY KEY, v text) PARTITION BY RANGE (id);
							CREATE TABLE %[1]s_a PARTITION OF %[1]s FOR VALUES FROM (0) TO (100);
							INSERT INTO %[1]s SELECT g, 'a' || g FROM generate_series(1, 50) g`, pt))
					},
					func() error { return waitReady(pt) },
					func() error { return del("public."+pt, pt, "id <= 15", false) },
					// A partition added later: set FULL by the capture before
					// the application deletes from it.
					func() error {
						return exec(fmt.Sprintf(`CREATE TABLE %[1]s_b PARTITION OF %[1]s FOR VALUES FROM (100) TO (200);
							INSERT INTO %[1]s SELECT g, 'b' || g FROM generate_series(100, 140) g`, pt))
					},
					func() error { return waitReady(pt) },
					func() error { return del("public."+pt, pt, "id <= 25 OR id BETWEEN 100 AND 120", false) },
					func() error {
						return del("public.base", "base", fmt.Sprintf("id BETWEEN %d AND %d", i*10+1, i*10+5), false)
					},
					// Odd rounds: dropped right after their last deletes.
					func() error { return del("public."+mt, mt, "true", i%2 == 1) },
					func() error { return del("public."+pt, pt, "true", i%2 == 1) },
				}
				for n, step := range steps {
					if err := step(); err != nil {
						return fmt.Errorf("round %d step %d: %w", i, n, err)
					}
					time.Sleep(time.Duration(rng.IntN(40)) * time.Millisecond) // pacing of a migration script, not synchronization
				}
			}
			return nil
		}()
	}()
	faults := chaos(ctx, rand.New(rand.NewPCG(seed, 13)), 700*time.Millisecond, 2500*time.Millisecond, map[string]func(){
		"kill-capture-1":  capture.Kill,
		"kill-capture-2":  capture.Kill,
		"kill-capture-3":  capture.Kill,
		"kill-capture-4":  capture.Kill,
		"kill-projector1": projector.Kill,
	})
	require.NoError(t, <-workloadDone)
	t.Logf("faults: %s", summary(faults))
	t.Logf("%s", capture.Stats())
	t.Logf("%s", projector.Stats())

	want := ledger.rows
	require.Greater(t, len(want), rounds*100)
	droppedTables := map[string]bool{}
	for _, d := range want {
		if d.dropped {
			droppedTables[d.table] = true
		}
	}
	for i := range want {
		want[i].dropped = droppedTables[want[i].table]
	}
	if _, err := watch.WaitDeletes(ctx, int64(len(want)), 3*time.Minute, nil); err != nil {
		t.Fatalf("%v\n%s", err, pipelineState(ctx, url, watch))
	}
	err = workload.WaitFor(ctx, 4*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
		return n >= int64(len(want)), err
	})
	require.NoError(t, err, "archive catching up\n%s", pipelineState(ctx, url, watch))

	type archivedRow struct {
		key, row json.RawMessage
		identity string
	}
	rows, err := conn.Query(ctx, `SELECT schema_name || '.' || table_name, (row->>'id')::bigint, key, row, identity FROM archive.rows WHERE source = 'main'`)
	require.NoError(t, err)
	got := map[string][]archivedRow{}
	for rows.Next() {
		var table string
		var id int64
		var a archivedRow
		require.NoError(t, rows.Scan(&table, &id, &a.key, &a.row, &a.identity))
		k := fmt.Sprintf("%s/%d", table, id)
		got[k] = append(got[k], a)
	}
	require.NoError(t, rows.Err())
	var problems []string
	droppedWithoutKey := 0
	for _, d := range want {
		k := fmt.Sprintf("%s/%d", d.table, d.id)
		as := got[k]
		if len(as) != 1 {
			problems = append(problems, fmt.Sprintf("%s archived %d times", k, len(as)))
			continue
		}
		a := as[0]
		delete(got, k)
		if !jsonEqual(a.row, d.row) {
			problems = append(problems, fmt.Sprintf("%s: archived %s, deleted %s", k, a.row, d.row))
		}
		if a.identity != "full" {
			problems = append(problems, fmt.Sprintf("%s: identity %s", k, a.identity))
		}
		wantKey := json.RawMessage(fmt.Sprintf(`{"id":%d}`, d.id))
		switch {
		case len(a.key) == 0 || string(a.key) == "null":
			if !d.dropped {
				problems = append(problems, fmt.Sprintf("%s: no key", k))
			}
			droppedWithoutKey++
		case !jsonEqual(a.key, wantKey):
			problems = append(problems, fmt.Sprintf("%s: key %s", k, a.key))
		}
	}
	for k := range got {
		problems = append(problems, k+" archived but never deleted")
	}
	sort.Strings(problems)
	if len(problems) > 10 {
		problems = append(problems[:10], fmt.Sprintf("... %d more", len(problems)-10))
	}
	require.Empty(t, problems, "archive vs deleted rows")
	keyed := 0
	for _, d := range want {
		if !d.dropped {
			keyed++
		}
	}
	require.Greater(t, keyed, rounds*50, "rows of tables never dropped, each checked for its key")
	t.Logf("%d rows deleted and archived, each once and equal; %d rows of tables never dropped, each with its key; %d rows of dropped tables archived without a key (decoded by a capture restarted after the drop)", len(want), keyed, droppedWithoutKey)
}

func jsonEqual(a, b json.RawMessage) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	ja, _ := json.Marshal(x)
	jb, _ := json.Marshal(y)
	return bytes.Equal(ja, jb)
}

// TestLostIdentityIsAGapInTheArchive: through the real binaries, a table
// whose primary key a migration drops is removed from the publication (the
// application's DELETE succeeds), and archive.gaps gets one lost_upstream
// row naming that table, which makes the archive not ready until it is
// acknowledged. Once the key is back the table's deletes are archived again.
func TestLostIdentityIsAGapInTheArchive(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, `CREATE TABLE items (id bigint PRIMARY KEY, v text); ALTER TABLE items REPLICA IDENTITY FULL;
		CREATE TABLE other (id bigint PRIMARY KEY); INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, 5) g`)
	require.NoError(t, err)

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	dataDir := t.TempDir() // the embedded broker's credentials: <dataDir>/nats
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	cenv := joinEnv(bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_lost"),
		"EPITAPH_TABLES=", "EPITAPH_CATALOG_POLL=200ms", "EPITAPH_HEARTBEAT_INTERVAL=1s",
		"EPITAPH_ALLOW_KEY_ONLY=true") // other is key-only, and items comes back key-only
	supervise(t, "capture", bins["capture"], cenv, seed)
	watch, err := bench.WatchStream(natsURL, "main", bench.EmbeddedCreds(dataDir))
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_lost", captureReadyTimeout, nil))
	m, err := bench.LocalAddr()
	require.NoError(t, err)
	supervise(t, "projector", bins["projector"], joinEnv(bench.ProjectorEnv(url, natsURL, m, "main", "worker-0"), "EPITAPH_LEASE_TTL=3s",
		"EPITAPH_NATS_CREDS="+filepath.Join(dataDir, "nats", "projector.creds")), seed+1, "run")

	_, err = conn.Exec(ctx, `DELETE FROM items WHERE id = 1`)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `ALTER TABLE items DROP CONSTRAINT items_pkey, REPLICA IDENTITY DEFAULT`)
	require.NoError(t, err)
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM pg_publication_tables WHERE pubname = 'epitaph_e2e_lost' AND tablename = 'items'`)
		return n == 0, err
	}), "removed from the publication")
	_, err = conn.Exec(ctx, `DELETE FROM items WHERE id = 2`)
	require.NoError(t, err, "the application's DELETE succeeds")

	require.NoError(t, workload.WaitFor(ctx, 2*time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM pg_namespace WHERE nspname = 'archive'`)
		if err != nil || n == 0 {
			return false, err
		}
		n, err = bench.Count(ctx, url, `SELECT count(*) FROM archive.gaps`)
		return n > 0, err
	}), "a gap reaches archive.gaps")
	var kind, schema, table string
	var partition *int
	var from, to string
	require.NoError(t, conn.QueryRow(ctx, `SELECT kind, schema_name, table_name, partition, from_lsn::text, to_lsn::text FROM archive.gaps`).
		Scan(&kind, &schema, &table, &partition, &from, &to))
	require.Equal(t, "lost_upstream", kind)
	require.Equal(t, "public", schema)
	require.Equal(t, "items", table)
	require.Nil(t, partition, "one row for the gap published to every partition")
	require.Equal(t, from, to)
	n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.gaps`)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	var ready bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT ready FROM archive.status WHERE state = 'live'`).Scan(&ready))
	require.False(t, ready, "an unacknowledged gap: not ready")

	// The key back: the table is published again and its deletes archived.
	_, err = conn.Exec(ctx, `ALTER TABLE items ADD PRIMARY KEY (id)`)
	require.NoError(t, err)
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM pg_publication_tables WHERE pubname = 'epitaph_e2e_lost' AND tablename = 'items'`)
		return n == 1, err
	}), "published again")
	_, err = conn.Exec(ctx, `DELETE FROM items WHERE id = 3`)
	require.NoError(t, err)
	require.NoError(t, workload.WaitFor(ctx, 2*time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE table_name = 'items'`)
		return n == 2, err
	}))
	var got string
	require.NoError(t, conn.QueryRow(ctx, `SELECT string_agg(format('%s:%s:%s', identity, key, row), ' ' ORDER BY commit_lsn, seq) FROM archive.rows WHERE table_name = 'items'`).Scan(&got))
	require.Equal(t, `full:{"id": 1}:{"v": "v1", "id": 1} key:{"id": 3}:{"id": 3}`, got,
		"rows 1 and 3 archived; row 2 was deleted while the table was not published (the gap)")
}

// TestKillsInsideTransactions SIGKILLs the capture twice while it
// publishes a transaction of 60,000 deletes, and checks the archive row by
// row after each.
//
//   - The first transaction deletes every row of a FULL table and drops
//     it. The restarted capture reads the table's keys from what it
//     recorded on the source (epitaph_capture.relation_facts), so it
//     decodes the rows it had stored exactly as before: it adopts them and
//     publishes the rest. Every row is archived once, equal, with its key;
//     nothing is quarantined.
//   - The second deletes every row of a table with an enum column, and
//     while the capture is down the enum type is renamed. The restarted
//     capture names the column's type anew, so the rows it had stored are
//     not what it publishes now: it publishes the whole transaction again,
//     and its signed commit covers that replay. The projector archives the
//     replay (the new type name) and quarantines the stale prefix alone. A
//     webhook on that table (queued, --no-revalidate) is sent each row
//     once: the stale rows' unverified deliveries were replaced at the
//     commit by the replay's.
func TestKillsInsideTransactions(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	const rows = 60_000
	url := testenv.NewDatabase(t) // source and target
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, fmt.Sprintf(`CREATE TABLE gone (id bigint PRIMARY KEY, v text);
		INSERT INTO gone SELECT g, 'v' || g FROM generate_series(1, %[1]d) g;
		CREATE TYPE mood AS ENUM ('calm', 'keen');
		CREATE TABLE moody (id bigint PRIMARY KEY, m mood, v text);
		INSERT INTO moody SELECT g, (ARRAY['calm', 'keen']::mood[])[1 + g %% 2], 'w' || g FROM generate_series(1, %[1]d) g`, rows))
	require.NoError(t, err)

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	dataDir := t.TempDir()
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	cenv := joinEnv(bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_kills"),
		"EPITAPH_TABLES=", "EPITAPH_SET_REPLICA_IDENTITY_FULL=true", "EPITAPH_HEARTBEAT_INTERVAL=1s")
	capture := supervise(t, "capture", bins["capture"], cenv, seed)
	watch, err := bench.WatchStream(natsURL, "main", bench.EmbeddedCreds(dataDir))
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_kills", captureReadyTimeout, nil))
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 20*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM pg_class WHERE relname IN ('gone', 'moody') AND relreplident = 'f'`)
		return n == 2, err
	}), "the capture set the tables FULL")

	// The webhook on moody: it accepts every request and counts the
	// requests per row id.
	var hookMu sync.Mutex
	sent := map[int64]int{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hs := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body handler.Body
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		var id int64
		_ = json.Unmarshal(body.Columns["id"], &id)
		hookMu.Lock()
		sent[id]++
		hookMu.Unlock()
		w.WriteHeader(http.StatusOK)
	})}
	go func() { _ = hs.Serve(ln) }()
	defer hs.Close()
	secretFile := filepath.Join(t.TempDir(), "hook.secret")
	require.NoError(t, os.WriteFile(secretFile, []byte(handler.NewSecret()+"\n"), 0o600))
	pcreds := "EPITAPH_NATS_CREDS=" + filepath.Join(dataDir, "nats", "projector.creds")
	add := exec.Command(bins["projector"], "handlers", "add", "--id", "55555555-5555-4555-8555-555555555555", "--table", "public.moody",
		"--kind", "webhook", "--target", "http://"+ln.Addr().String()+"/hook", "--backoff", "100ms", "--secret-file", secretFile,
		"--columns", "id", "--no-revalidate")
	add.Env = append(os.Environ(), joinEnv(bench.ProjectorEnv(url, natsURL, "", "main", "cli"), pcreds)...)
	out, err := add.CombinedOutput()
	require.NoError(t, err, string(out))
	m, err := bench.LocalAddr()
	require.NoError(t, err)
	supervise(t, "projector", bins["projector"], joinEnv(bench.ProjectorEnv(url, natsURL, m, "main", "worker-0"), pcreds), seed+1, "run")

	// deleteAll deletes every row of table in one transaction (then drops
	// it when drop), and SIGKILLs the capture once 500 of its rows are in
	// the stream, well before its commit; held: the restart waits for
	// capture.Release.
	deleteAll := func(table string, drop, held bool) *migrationLedger {
		before, err := watch.Deletes(ctx)
		require.NoError(t, err)
		var ledger migrationLedger
		require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if err := ledger.deleteReturning(ctx, tx, "public."+table, `DELETE FROM `+table+` t RETURNING id, to_jsonb(t)`, drop); err != nil {
				return err
			}
			if drop {
				_, err := tx.Exec(ctx, `DROP TABLE `+table)
				return err
			}
			return nil
		}))
		require.Len(t, ledger.rows, rows)
		var seen int64
		require.NoError(t, workload.WaitFor(ctx, time.Minute, time.Millisecond, func(ctx context.Context) (bool, error) {
			n, err := watch.Deletes(ctx)
			seen = n
			return n >= before+500, err
		}))
		// The embedded broker dies with the capture: the stream is read
		// again once the capture is back.
		if held {
			capture.KillHeld()
		} else {
			capture.Kill()
		}
		require.Less(t, seen, before+rows, "%s: killed inside the transaction", table)
		return &ledger
	}
	quarantined := func() int64 {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM epitaph.quarantine")
		require.NoError(t, err)
		return n
	}
	// archivedOnce checks the table's archived rows against the ledger:
	// each once, equal, keyed by id; it returns the column types archived.
	archivedOnce := func(table string, ledger *migrationLedger) map[string]int {
		require.NoError(t, workload.WaitFor(ctx, 3*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
			n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE table_name = $1", table)
			return n >= rows, err
		}), "%s: archive catching up\n%s", table, pipelineState(ctx, url, watch))
		got := map[int64][]json.RawMessage{}
		types := map[string]int{}
		rs, err := conn.Query(ctx, `SELECT (row->>'id')::bigint, row, key, identity, columns::text FROM archive.rows WHERE table_name = $1`, table)
		require.NoError(t, err)
		for rs.Next() {
			var id int64
			var row, key json.RawMessage
			var identity, columns string
			require.NoError(t, rs.Scan(&id, &row, &key, &identity, &columns))
			require.Equal(t, "full", identity)
			require.True(t, jsonEqual(key, json.RawMessage(fmt.Sprintf(`{"id":%d}`, id))), "%s row %d: key %s", table, id, key)
			got[id] = append(got[id], row)
			types[columns]++
		}
		require.NoError(t, rs.Err())
		var problems []string
		for _, d := range ledger.rows {
			switch as := got[d.id]; {
			case len(as) != 1:
				problems = append(problems, fmt.Sprintf("row %d archived %d times", d.id, len(as)))
			case !jsonEqual(as[0], d.row):
				problems = append(problems, fmt.Sprintf("row %d: archived %s, deleted %s", d.id, as[0], d.row))
			}
			delete(got, d.id)
		}
		for id := range got {
			problems = append(problems, fmt.Sprintf("row %d archived but never deleted", id))
		}
		sort.Strings(problems)
		if len(problems) > 10 {
			problems = append(problems[:10], fmt.Sprintf("... %d more", len(problems)-10))
		}
		require.Empty(t, problems, "%s: archive vs deleted rows", table)
		return types
	}

	// 1. DELETE + DROP TABLE, killed inside: the recorded keys make the
	// replay the same, adopted.
	gone := deleteAll("gone", true, false)
	archivedOnce("gone", gone)
	inStream, err := watch.Deletes(ctx)
	require.NoError(t, err)
	require.EqualValues(t, rows, inStream, "the stored rows adopted, none published twice")
	require.Zero(t, quarantined(), "nothing quarantined")

	// 2. The enum renamed while the capture is down: the replay differs.
	moody := deleteAll("moody", false, true)
	_, err = conn.Exec(ctx, `ALTER TYPE mood RENAME TO feeling`)
	require.NoError(t, err)
	capture.Release()
	_, err = watch.WaitDeletes(ctx, 2*rows+1, 3*time.Minute, nil) // the replay follows the stale prefix
	require.NoError(t, err, "the restarted capture publishes the transaction again\n%s", pipelineState(ctx, url, watch))
	types := archivedOnce("moody", moody)
	require.Len(t, types, 1, "one copy of every row, the replay's: %v", types)
	for cols := range types {
		require.Contains(t, cols, `"public.feeling"`, "the replay's column types")
	}
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := watch.Deletes(ctx)
		return quarantined() == n-2*rows, err
	}), "the stale prefix, and nothing else, is quarantined")
	var stale int64
	var subjects, cats []string
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*), COALESCE(array_agg(DISTINCT regexp_replace(subject, '^epitaph\.main\.[0-9]+\.', '')), '{}'),
		COALESCE(array_agg(DISTINCT category), '{}') FROM epitaph.quarantine`).Scan(&stale, &subjects, &cats))
	require.Positive(t, stale, "the replay differed from the stored prefix (the case under test)")
	require.Equal(t, []string{"delete.public.moody"}, subjects)
	require.Equal(t, []string{"unauthenticated"}, cats)

	// The webhook: every row sent once, nothing else.
	require.NoError(t, workload.WaitFor(ctx, 2*time.Minute, 100*time.Millisecond, func(context.Context) (bool, error) {
		hookMu.Lock()
		defer hookMu.Unlock()
		return len(sent) >= rows, nil
	}), "the webhook is sent every row")
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM epitaph.deliveries WHERE state NOT IN ('done', 'stopped')`)
		return n == 0, err
	}), "every delivery settled")
	hookMu.Lock()
	defer hookMu.Unlock()
	for _, d := range moody.rows {
		require.Equal(t, 1, sent[d.id], "row %d sent once", d.id)
	}
	require.Len(t, sent, rows, "nothing else sent")
	done, err := bench.Count(ctx, url, `SELECT count(*) FROM epitaph.deliveries WHERE state = 'done'`)
	require.NoError(t, err)
	all, err := bench.Count(ctx, url, `SELECT count(*) FROM epitaph.deliveries`)
	require.NoError(t, err)
	require.Equal(t, []int64{rows, rows}, []int64{done, all}, "one delivery per row, done: a stale copy's was replaced by the replay's")
	t.Logf("%d rows of a dropped table archived once each with their keys, nothing quarantined; %d rows archived once each after a type rename, the stale prefix of %d rows quarantined, the webhook sent each row once",
		rows, rows, stale)
}
