// Command ddlguard is `make bench-ddlguard`: what the capture's DDL guard
// (--install-ddl-guard) adds to the application's DDL.
//
// On one throwaway Postgres holding -tables published tables, it runs loops
// of -pairs CREATE TABLE + DROP TABLE pairs on one session, in -rounds
// interleaved rounds (the order rotating from round to round), each loop
// with exactly one of these event triggers enabled:
//
//   - none: no event trigger (the application's DDL alone);
//   - empty: an empty PL/pgSQL function (PostgreSQL's event trigger
//     machinery and a call);
//   - definer, definer+search_path, definer+set: empty, SECURITY DEFINER,
//     then with SET search_path, then with the old guard's SET clauses;
//   - definer+set+exception: that with an EXCEPTION block entered;
//   - baseline: the inline guard before its fast path (baseline.go);
//   - guard: the capture's inline guard (--ddl-guard-mode inline);
//   - notify: the capture's notify guard (--ddl-guard-mode notify, the
//     default), as it runs on a server without prepared transactions
//     (max_prepared_transactions = 0, which the bench sets): pg_notify;
//   - notify unheard: the same on a channel nobody listens on (what NOTIFY
//     costs the committing backend without waking a listener and its
//     check);
//   - message: the notify guard's other branch, on a server with prepared
//     transactions: a transactional logical message (nothing decodes it
//     here, so no check follows it);
//   - by hand (keyed tables only): no trigger, ALTER PUBLICATION .. ADD
//     TABLE written in the CREATE's transaction: the part of publishing a
//     table that no guard can avoid.
//
// Unkeyed tables (nothing to publish) and keyed ones (the guard publishes
// them) are measured separately. For each variant it prints the median
// per pair, of wall-clock time and of the backend's CPU time, and the
// median of the per-round ratios against the loop without a trigger run
// in the same round (and for keyed tables against by hand), beside their
// limits: the guard adds at most 5% where it has nothing to do, and at
// most 5% over publishing by hand; the notify guard at most 5% over no
// trigger in both. Then the time spent inside each
// function per call (pg_stat_user_functions, track_functions = all; for
// the baseline and the guard also per round, with the least-disturbed
// one) and the first CREATE TABLE of -sessions fresh sessions (the
// function compiled and its queries planned anew in each session).
// Last, -latency tables are created one at a time with the notify guard
// while a capture-like loop LISTENs on its channel and publishes what it
// finds at each notification: the time from the CREATE TABLE's commit to
// the table being in the publication.
//
// Output lines are "BENCH <name> <value> <unit>" and "NOTE <text>".
// EPITAPH_TEST_PG=<major> picks the server (see internal/testenv).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/pgquote"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

const pub = "bench"

// notifyPub is the publication of the notify guard (one guard per
// publication).
const notifyPub = "bench_notify"

// quietPub is the publication of a notify guard nobody listens to.
const quietPub = "bench_quiet"

// warned returns an error naming the first WARNING the loops' session got.
var warned = func() error { return nil }

// limitPct is the most the guard may add, in percent: over no guard where
// it has nothing to do, over publishing by hand where it publishes.
const limitPct = 5.0

type options struct {
	tables, pairs, rounds, sessions, latency int
	// backend is the pid of the loops' session's backend, whose CPU time
	// is read from /proc.
	backend int
}

func main() {
	var o options
	flag.IntVar(&o.tables, "tables", 300, "published tables in the database before the loops")
	flag.IntVar(&o.pairs, "pairs", 25, "CREATE TABLE + DROP TABLE pairs per loop")
	flag.IntVar(&o.rounds, "rounds", 11, "interleaved rounds (every variant once per round; medians reported)")
	flag.IntVar(&o.sessions, "sessions", 15, "fresh sessions timed on their first CREATE TABLE, per variant (0 skips)")
	flag.IntVar(&o.latency, "latency", 30, "tables timed from their CREATE TABLE's commit to their publication by the notify guard's signal (0 skips)")
	flag.Parse()
	if o.tables < 0 || o.pairs < 1 || o.rounds < 1 || o.sessions < 0 || o.latency < 0 {
		fmt.Fprintln(os.Stderr, "bench-ddlguard: -pairs and -rounds must be at least 1, -tables, -sessions and -latency at least 0")
		os.Exit(2)
	}
	if err := run(context.Background(), o); err != nil {
		fmt.Fprintln(os.Stderr, "bench-ddlguard:", err)
		os.Exit(1)
	}
}

// variant is one way of running the loop: trigger is the event trigger
// enabled for it ("" for none), byHand adds the table to the publication in
// the CREATE's transaction.
type variant struct {
	name, trigger, function string
	byHand, keyedOnly       bool
}

func run(ctx context.Context, o options) error {
	bench.LoadNote("start")
	defer bench.LoadNote("end")
	pg, err := testenv.StartPostgres()
	if err != nil {
		return err
	}
	defer func() {
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	}()
	// PostgreSQL's default: the notify guard sends a notification.
	if err := pg.SetConfig("max_prepared_transactions = 0"); err != nil {
		return err
	}
	if err := pg.Restart(); err != nil {
		return err
	}
	url, err := bench.CreateDatabase(ctx, pg, "guard")
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	var version string
	if err := pool.QueryRow(ctx, `SHOW server_version`).Scan(&version); err != nil {
		return err
	}
	bench.Note("PostgreSQL %s, %d published tables, %d pairs per loop, %d rounds", version, o.tables, o.pairs, o.rounds)
	variants, err := install(ctx, pool, o)
	if err != nil {
		return err
	}
	cc, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	// A guard that fails says so in a WARNING and lets the DDL through:
	// any WARNING ends the bench.
	var warning string
	cc.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if n.Severity == "WARNING" && warning == "" {
			warning = n.Message
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	warned = func() error {
		if warning != "" {
			return fmt.Errorf("the server warned: %s", warning)
		}
		return nil
	}
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&o.backend); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `SET track_functions = 'all'`); err != nil {
		return err
	}
	// The capture's LISTEN, there all along as in production: the notify
	// guard's commits signal it.
	lis, err := listen(ctx, url, pool)
	if err != nil {
		return err
	}
	defer lis.stop()
	for _, keyed := range []bool{false, true} {
		if err := loops(ctx, conn, variants, keyed, o); err != nil {
			return err
		}
	}
	if o.sessions > 0 {
		if err := freshSessions(ctx, conn, url, variants, o); err != nil {
			return err
		}
	}
	if o.latency > 0 {
		return latency(ctx, conn, variants, lis, o)
	}
	return nil
}

// install creates the published tables, the publication, the capture's
// guard and the other variants' functions and event triggers, all
// disabled.
func install(ctx context.Context, pool *pgxpool.Pool, o options) ([]variant, error) {
	if _, err := pool.Exec(ctx, fmt.Sprintf(`DO $$ BEGIN FOR i IN 1..%d LOOP
		EXECUTE format('CREATE TABLE pre%%s (id int PRIMARY KEY, v text)', i); END LOOP; END $$`, o.tables)); err != nil {
		return nil, fmt.Errorf("create tables: %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE PUBLICATION `+pub); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `DO $$ DECLARE r record; BEGIN
		FOR r IN SELECT relname FROM pg_class WHERE relname ~ '^pre[0-9]+$' AND relkind = 'r' LOOP
			EXECUTE format('ALTER PUBLICATION `+pub+` ADD TABLE %I', r.relname); END LOOP; END $$`); err != nil {
		return nil, fmt.Errorf("publish tables: %w", err)
	}
	if err := capture.InstallDDLGuard(ctx, pool, &capture.Config{PublicationName: pub, DDLGuardMode: capture.DDLGuardInline}); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `CREATE PUBLICATION `+notifyPub); err != nil {
		return nil, err
	}
	for _, p := range []string{notifyPub, quietPub} {
		if p == quietPub {
			if _, err := pool.Exec(ctx, `CREATE PUBLICATION `+quietPub); err != nil {
				return nil, err
			}
		}
		if err := capture.InstallDDLGuard(ctx, pool, &capture.Config{PublicationName: p, DDLGuardMode: capture.DDLGuardNotify}); err != nil {
			return nil, err
		}
	}
	guardTrigger := "epitaph_ddl_guard_" + pub
	var tags []string
	if err := pool.QueryRow(ctx, `SELECT evttags FROM pg_event_trigger WHERE evtname = $1`, guardTrigger).Scan(&tags); err != nil {
		return nil, fmt.Errorf("read the guard's event trigger %s: %w", guardTrigger, err)
	}
	var quoted []string
	for _, t := range tags {
		quoted = append(quoted, pgquote.Literal(t))
	}
	when := "WHEN TAG IN (" + strings.Join(quoted, ", ") + ")"
	const set = `SECURITY DEFINER SET search_path = pg_catalog SET lock_timeout = '1ms'`
	probes := []struct{ name, def string }{
		{"empty", `LANGUAGE plpgsql AS $f$ BEGIN END $f$`},
		{"definer", `LANGUAGE plpgsql SECURITY DEFINER AS $f$ BEGIN END $f$`},
		{"definer+search_path", `LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $f$ BEGIN END $f$`},
		{"definer+set", `LANGUAGE plpgsql ` + set + ` AS $f$ BEGIN END $f$`},
		{"definer+set+exception", `LANGUAGE plpgsql ` + set + ` AS $f$ BEGIN
			BEGIN PERFORM 1; EXCEPTION WHEN OTHERS THEN RAISE WARNING '%', SQLERRM; END; END $f$`},
		// The notify guard's branch on a server with prepared transactions.
		{"message", `LANGUAGE plpgsql SECURITY DEFINER AS $f$ BEGIN
			PERFORM pg_catalog.pg_logical_emit_message(true, 'epitaph.ddl', ''); END $f$`},
	}
	variants := []variant{{name: "none"}}
	for _, p := range probes {
		fn := "epitaph.bench_" + strings.NewReplacer("+", "_").Replace(p.name)
		variants = append(variants, variant{name: p.name, trigger: "bench_" + strings.NewReplacer("+", "_").Replace(p.name), function: fn})
		if _, err := pool.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS event_trigger `+p.def); err != nil {
			return nil, fmt.Errorf("create %s: %w", p.name, err)
		}
	}
	baseline := fmt.Sprintf(baselineGuard, pgquote.Literal(pub), "NULL", "false", pgquote.Literal(event.PrefixGap),
		pgquote.Literal("removed from the publication: it lost its usable replica identity"), "epitaph.bench_baseline", "true")
	if _, err := pool.Exec(ctx, baseline); err != nil {
		return nil, fmt.Errorf("create the baseline guard: %w", err)
	}
	variants = append(variants,
		variant{name: "baseline", trigger: "bench_baseline", function: "epitaph.bench_baseline"},
		variant{name: "guard", trigger: guardTrigger, function: "epitaph.ddl_guard_" + pub},
		variant{name: "notify", trigger: "epitaph_ddl_guard_" + notifyPub, function: "epitaph.ddl_guard_" + notifyPub},
		variant{name: "notify unheard", trigger: "epitaph_ddl_guard_" + quietPub, function: "epitaph.ddl_guard_" + quietPub},
		variant{name: "by hand", byHand: true, keyedOnly: true})
	for _, v := range variants {
		if v.trigger == "" {
			continue
		}
		if v.trigger != guardTrigger && !strings.HasPrefix(v.name, "notify") {
			if _, err := pool.Exec(ctx, `CREATE EVENT TRIGGER `+v.trigger+` ON ddl_command_end `+when+` EXECUTE FUNCTION `+v.function+`()`); err != nil {
				return nil, fmt.Errorf("create event trigger %s: %w", v.trigger, err)
			}
		}
		if _, err := pool.Exec(ctx, `ALTER EVENT TRIGGER `+v.trigger+` DISABLE`); err != nil {
			return nil, err
		}
	}
	return variants, nil
}

// enable enables v's event trigger and disables every other one.
func enable(ctx context.Context, conn *pgx.Conn, variants []variant, v variant) error {
	for _, o := range variants {
		if o.trigger == "" {
			continue
		}
		state := "DISABLE"
		if o.trigger == v.trigger {
			state = "ENABLE"
		}
		if _, err := conn.Exec(ctx, `ALTER EVENT TRIGGER `+o.trigger+` `+state); err != nil {
			return err
		}
	}
	return nil
}

// loop runs o.pairs CREATE TABLE + DROP TABLE pairs with v and returns the
// milliseconds per pair, of wall-clock time and of the backend's CPU time.
func loop(ctx context.Context, conn *pgx.Conn, v variant, keyed bool, o options) (wall, cpu float64, err error) {
	cpu0, err := backendCPU(o.backend)
	if err != nil {
		return 0, 0, err
	}
	def := "(id int, v text)"
	if keyed {
		def = "(id int PRIMARY KEY, v text)"
	}
	start := time.Now()
	for i := range o.pairs {
		sql := fmt.Sprintf("CREATE TABLE loop%d %s", i, def)
		if v.byHand {
			sql = fmt.Sprintf("BEGIN; %s; ALTER PUBLICATION %s ADD TABLE ONLY loop%d; COMMIT", sql, pub, i)
		}
		if _, err := conn.Exec(ctx, sql); err != nil {
			return 0, 0, fmt.Errorf("%s: %w", v.name, err)
		}
		if err := warned(); err != nil {
			return 0, 0, fmt.Errorf("%s: %w", v.name, err)
		}
		if keyed && i == 0 && (v.byHand || v.name == "guard" || v.name == "baseline") {
			// Published in the CREATE's transaction, by hand or by the guard.
			var in bool
			if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND tablename = 'loop0')`, pub).Scan(&in); err != nil {
				return 0, 0, err
			}
			if !in {
				return 0, 0, fmt.Errorf("%s: loop0 was not published", v.name)
			}
		}
		if _, err := conn.Exec(ctx, fmt.Sprintf("DROP TABLE loop%d", i)); err != nil {
			return 0, 0, fmt.Errorf("%s: %w", v.name, err)
		}
	}
	wall = float64(time.Since(start)) / float64(time.Millisecond) / float64(o.pairs)
	cpu1, err := backendCPU(o.backend)
	if err != nil {
		return 0, 0, err
	}
	return wall, (cpu1 - cpu0) / float64(o.pairs), nil
}

// backendCPU is the CPU time, in milliseconds, the process pid has run
// (/proc/<pid>/schedstat: nanoseconds, unlike the 10 ms ticks of stat).
func backendCPU(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
	if err != nil {
		return 0, fmt.Errorf("the backend's CPU time: %w", err)
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, fmt.Errorf("the backend's CPU time: /proc/%d/schedstat is empty", pid)
	}
	ns, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0, fmt.Errorf("the backend's CPU time: %w", err)
	}
	return ns / 1e6, nil
}

func loops(ctx context.Context, conn *pgx.Conn, all []variant, keyed bool, o options) error {
	kind := "unkeyed"
	if keyed {
		kind = "keyed"
	}
	var variants []variant
	for _, v := range all {
		if keyed || !v.keyedOnly {
			variants = append(variants, v)
		}
	}
	// Warm up: every function compiled and its plans cached.
	for _, v := range variants {
		if err := enable(ctx, conn, all, v); err != nil {
			return err
		}
		if _, _, err := loop(ctx, conn, v, keyed, options{pairs: 3, backend: o.backend}); err != nil {
			return err
		}
	}
	perPair, cpuPerPair, insidePerCall, err := rounds(ctx, conn, all, variants, keyed, o)
	if err != nil {
		return err
	}
	if err := enable(ctx, conn, all, variant{}); err != nil {
		return err
	}
	report(kind, "wall", keyed, variants, perPair, o)
	report(kind, "cpu", keyed, variants, cpuPerPair, o)
	inside, err := functionTimes(ctx, conn, kind)
	if err != nil {
		return err
	}
	// The time inside the function, beside the pair without a trigger, is
	// what the guard adds short of PostgreSQL's event trigger machinery.
	// The least-disturbed rounds (the minimum) say most on a loaded
	// machine.
	for _, v := range variants {
		if ms, ok := inside[v.function]; ok && (v.name == "baseline" || v.name == "guard" || v.name == "notify") {
			bench.Figure(fmt.Sprintf("ddlguard.%s.%s.inside_vs_none_cpu_pct", kind, slug(v.name)), 100*ms/bench.Median(cpuPerPair["none"]),
				"% of the backend's median CPU time per pair without a trigger, spent inside the function")
		}
		if rs := insidePerCall[v.name]; len(rs) > 0 {
			best := slices.Min(rs)
			bench.Figure(fmt.Sprintf("ddlguard.%s.%s.inside_best_ms_per_call", kind, slug(v.name)), best,
				fmt.Sprintf("ms inside the function per call in its least-disturbed round (median %.3f)", bench.Median(rs)))
			bench.Figure(fmt.Sprintf("ddlguard.%s.%s.inside_best_vs_none_best_pct", kind, slug(v.name)), 100*best/slices.Min(perPair["none"]),
				"% of the fastest round's pair without a trigger (wall-clock)")
		}
	}
	return nil
}

// insideTime is the total milliseconds spent inside the function fn and
// its number of calls so far, this session's counters flushed first.
func insideTime(ctx context.Context, conn *pgx.Conn, fn string) (ms float64, calls int64, err error) {
	if _, err := conn.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		return 0, 0, err
	}
	err = conn.QueryRow(ctx, `SELECT COALESCE(sum(total_time), 0)::float8, COALESCE(sum(calls), 0)::int8
		FROM pg_stat_user_functions WHERE schemaname || '.' || funcname = $1`, fn).Scan(&ms, &calls)
	return ms, calls, err
}

// rounds runs o.rounds interleaved rounds of every variant's loop, the
// order rotating, and returns per variant the milliseconds per pair of
// each round (wall-clock and the backend's CPU) and, for the baseline and
// the guard, the milliseconds inside the function per call.
func rounds(ctx context.Context, conn *pgx.Conn, all, variants []variant, keyed bool, o options) (perPair, cpuPerPair, insidePerCall map[string][]float64, err error) {
	perPair = make(map[string][]float64)
	cpuPerPair = make(map[string][]float64)
	if _, err := conn.Exec(ctx, `SELECT pg_stat_reset()`); err != nil {
		return nil, nil, nil, err
	}
	// The time inside the baseline's and the guard's function, per round
	// (PostgreSQL 15+ flushes a session's counters on request).
	perRound := true
	if _, err := conn.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		perRound = false
		bench.Note("no pg_stat_force_next_flush (PostgreSQL 14): no time inside the functions per round")
	}
	insidePerCall = make(map[string][]float64)
	for r := range o.rounds {
		for i := range variants {
			v := variants[(i+r)%len(variants)]
			if err := enable(ctx, conn, all, v); err != nil {
				return nil, nil, nil, err
			}
			timed := perRound && (v.name == "baseline" || v.name == "guard" || v.name == "notify")
			var ms0 float64
			var calls0 int64
			if timed {
				var err error
				if ms0, calls0, err = insideTime(ctx, conn, v.function); err != nil {
					return nil, nil, nil, err
				}
			}
			wall, cpu, err := loop(ctx, conn, v, keyed, o)
			if err != nil {
				return nil, nil, nil, err
			}
			perPair[v.name] = append(perPair[v.name], wall)
			cpuPerPair[v.name] = append(cpuPerPair[v.name], cpu)
			if timed {
				ms1, calls1, err := insideTime(ctx, conn, v.function)
				if err != nil {
					return nil, nil, nil, err
				}
				insidePerCall[v.name] = append(insidePerCall[v.name], (ms1-ms0)/float64(max(calls1-calls0, 1)))
			}
		}
	}
	return perPair, cpuPerPair, insidePerCall, nil
}

// report prints each variant's median per pair and its ratios to the loops
// without a trigger and by hand of the same rounds, and the verdict; what
// is "wall" (wall-clock time) or "cpu" (the backend's CPU time, which
// moves much less with the machine's load).
func report(kind, what string, keyed bool, variants []variant, perPair map[string][]float64, o options) {
	// ratio is the median over the rounds of a's loop over b's in the same
	// round, as a percentage added.
	ratio := func(a, b string) float64 {
		var rs []float64
		for i := range perPair[a] {
			rs = append(rs, perPair[a][i]/perPair[b][i])
		}
		return 100 * (bench.Median(rs) - 1)
	}
	unit := map[string]string{"wall": "ms", "cpu": "ms of the backend's CPU"}[what]
	for _, v := range variants {
		bench.Figure(fmt.Sprintf("ddlguard.%s.%s.%s_ms_per_pair", kind, slug(v.name), what), bench.Median(perPair[v.name]),
			fmt.Sprintf("%s per CREATE TABLE + DROP TABLE (median of %d rounds)", unit, o.rounds))
	}
	limit := fmt.Sprintf("; limit <= %.0f%%", limitPct)
	for _, v := range variants {
		if v.name == "none" {
			continue
		}
		note := "% added over no trigger (median of the rounds' ratios)"
		if (v.name == "guard" && !keyed) || v.name == "notify" {
			note += limit
		}
		bench.Figure(fmt.Sprintf("ddlguard.%s.%s.%s_vs_none_pct", kind, slug(v.name), what), ratio(v.name, "none"), note)
	}
	if keyed {
		for _, name := range []string{"baseline", "guard"} {
			note := "% added over ALTER PUBLICATION .. ADD TABLE by hand in the CREATE's transaction"
			if name == "guard" {
				note += limit
			}
			bench.Figure(fmt.Sprintf("ddlguard.keyed.%s.%s_vs_by_hand_pct", name, what), ratio(name, "by hand"), note)
		}
	}
	against, pct, was := "no guard", ratio("guard", "none"), ratio("baseline", "none")
	if keyed {
		against, pct, was = "publishing by hand", ratio("guard", "by hand"), ratio("baseline", "by hand")
	}
	met := "met"
	if pct > limitPct {
		met = "NOT met"
	}
	bench.Note("%s, %s time: the inline guard adds %+.1f%% over %s (the baseline %+.1f%%; limit %.0f%%: %s)", kind, what, pct, against, was, limitPct, met)
	pct, met = ratio("notify", "none"), "met"
	if pct > limitPct {
		met = "NOT met"
	}
	bench.Note("%s, %s time: the notify guard adds %+.1f%% over no guard (unheard %+.1f%%, the logical message instead %+.1f%%; limit %.0f%%: %s)",
		kind, what, pct, ratio("notify unheard", "none"), ratio("message", "none"), limitPct, met)
}

func slug(name string) string { return strings.NewReplacer(" ", "_", "+", "_").Replace(name) }

// functionTimes prints the time spent inside each variant's function per
// call in the rounds of kind (pg_stat_user_functions).
func functionTimes(ctx context.Context, conn *pgx.Conn, kind string) (map[string]float64, error) {
	if _, err := conn.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		time.Sleep(1500 * time.Millisecond) // before PostgreSQL 15: the collector's next report
	}
	time.Sleep(200 * time.Millisecond)
	rows, err := conn.Query(ctx, `SELECT schemaname || '.' || funcname, calls, total_time, self_time
		FROM pg_stat_user_functions WHERE schemaname = 'epitaph' ORDER BY funcname`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	inside := make(map[string]float64)
	for rows.Next() {
		var name string
		var calls int64
		var total, self float64
		if err := rows.Scan(&name, &calls, &total, &self); err != nil {
			return nil, err
		}
		ms := total / float64(max(calls, 1))
		inside[name] = ms
		bench.Figure("ddlguard."+kind+".function."+strings.TrimPrefix(name, "epitaph.")+".ms_per_call", ms,
			fmt.Sprintf("ms inside the function per call (total; self %.3f ms), %d calls", self/float64(max(calls, 1)), calls))
	}
	return inside, rows.Err()
}

// freshSessions times the first keyed CREATE TABLE of new sessions with no
// trigger, the baseline and the guard, interleaved: a session's first call
// compiles the function and plans its queries.
func freshSessions(ctx context.Context, admin *pgx.Conn, url string, all []variant, o options) error {
	var variants []variant
	for _, v := range all {
		if v.name == "none" || v.name == "baseline" || v.name == "guard" || v.name == "notify" {
			variants = append(variants, v)
		}
	}
	times := make(map[string][]float64)
	for s := range o.sessions {
		for i := range variants {
			v := variants[(i+s)%len(variants)]
			if err := enable(ctx, admin, all, v); err != nil {
				return err
			}
			conn, err := pgx.Connect(ctx, url)
			if err != nil {
				return err
			}
			start := time.Now()
			_, err = conn.Exec(ctx, `CREATE TABLE fresh (id int PRIMARY KEY, v text)`)
			took := float64(time.Since(start)) / float64(time.Millisecond)
			if err == nil {
				_, err = conn.Exec(ctx, `DROP TABLE fresh`)
			}
			_ = conn.Close(ctx)
			if err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
			times[v.name] = append(times[v.name], took)
		}
	}
	if err := enable(ctx, admin, all, variant{}); err != nil {
		return err
	}
	for _, v := range variants {
		bench.Figure("ddlguard.fresh_session."+slug(v.name)+".first_create_ms", bench.Median(times[v.name]),
			fmt.Sprintf("ms, a new session's first keyed CREATE TABLE (median of %d)", o.sessions))
	}
	return nil
}

// settle is how long the capture lets a burst of the notify guard's
// signals gather before its catalog check (capture's ddlSettle).
const settle = 20 * time.Millisecond

// notifyChannel is the channel of the notify guard of notifyPub (the
// capture's guardChannel).
const notifyChannel = "epitaph_ddl_" + notifyPub

// listener is a capture-like follower of the notify guard: it LISTENs on
// its channel and, as the capture does, coalesces the notifications into
// checks run one at a time: each adds the tables named lat* that
// notifyPub lacks, reporting each add once committed.
type listener struct {
	conn      *pgx.Conn
	cancel    context.CancelFunc
	done      chan struct{}
	published chan string // a table's name, once its add committed
	err       error
}

func listen(ctx context.Context, url string, pool *pgxpool.Pool) (*listener, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{notifyChannel}.Sanitize()); err != nil {
		_ = conn.Close(ctx)
		return nil, err
	}
	lctx, cancel := context.WithCancel(ctx)
	l := &listener{conn: conn, cancel: cancel, done: make(chan struct{}), published: make(chan string, 1024)}
	kick := make(chan struct{}, 1)
	checked := make(chan error, 1)
	var due atomic.Bool
	go func() {
		for {
			select {
			case <-lctx.Done():
				checked <- nil
				return
			case <-kick:
			}
			if err := l.publish(lctx, pool); err != nil {
				cancel() // ends the wait for notifications too
				checked <- err
				return
			}
		}
	}()
	go func() {
		defer close(l.done)
		for {
			if _, err := conn.WaitForNotification(lctx); err != nil {
				cancel()
				switch cerr := <-checked; {
				case cerr != nil:
					l.err = cerr
				case ctx.Err() == nil && !errors.Is(err, context.Canceled):
					l.err = err
				}
				return
			}
			// As the capture does: one check per burst, settle after
			// the first signal.
			if due.CompareAndSwap(false, true) {
				time.AfterFunc(settle, func() {
					due.Store(false)
					select {
					case kick <- struct{}{}:
					default:
					}
				})
			}
		}
	}()
	return l, nil
}

// publish adds the lat* tables notifyPub lacks, as the capture's catalog
// check adds new tables.
func (l *listener) publish(ctx context.Context, pool *pgxpool.Pool) error {
	rows, err := pool.Query(ctx, `SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname LIKE 'lat%'
		  AND NOT EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
		                  WHERE p.pubname = $1 AND pr.prrelid = c.oid)`, notifyPub)
	if err != nil {
		return err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, n := range names {
		if _, err := pool.Exec(ctx, "ALTER PUBLICATION "+notifyPub+" ADD TABLE ONLY "+pgx.Identifier{n}.Sanitize()); err != nil {
			return err
		}
		l.published <- n
	}
	return nil
}

func (l *listener) stop() {
	l.cancel()
	<-l.done
	_ = l.conn.Close(context.Background())
}

// latency creates o.latency keyed tables one at a time with the notify
// guard enabled and times each from its CREATE TABLE's commit to the
// listener's add committing.
func latency(ctx context.Context, conn *pgx.Conn, all []variant, l *listener, o options) error {
	for _, v := range all {
		if v.name != "notify" {
			continue
		}
		if err := enable(ctx, conn, all, v); err != nil {
			return err
		}
	}
	var times []float64
	for i := range o.latency {
		name := fmt.Sprintf("lat%d", i)
		if _, err := conn.Exec(ctx, "CREATE TABLE "+name+" (id int PRIMARY KEY, v text)"); err != nil {
			return err
		}
		committed := time.Now()
		select {
		case got := <-l.published:
			if got != name {
				return fmt.Errorf("published %s, want %s", got, name)
			}
		case <-l.done:
			return fmt.Errorf("the listener stopped: %v", l.err)
		case <-time.After(10 * time.Second):
			return fmt.Errorf("%s not published 10 s after its CREATE TABLE", name)
		}
		times = append(times, float64(time.Since(committed))/float64(time.Millisecond))
		if _, err := conn.Exec(ctx, "DROP TABLE "+name); err != nil {
			return err
		}
	}
	if err := enable(ctx, conn, all, variant{}); err != nil {
		return err
	}
	bench.Figure("ddlguard.notify.commit_to_published_ms", bench.Median(times),
		fmt.Sprintf("ms from a keyed CREATE TABLE's commit to the table in the publication, LISTEN + check + ALTER PUBLICATION (median of %d; max %.1f)",
			len(times), slices.Max(times)))
	return nil
}
