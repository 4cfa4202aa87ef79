package e2e_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// runCapture runs the capture binary to its end with exactly env (and
// PATH, HOME), returning its stdout, stderr and exit code.
func runCapture(t *testing.T, bin string, env []string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		t.Fatalf("run %s: %v", bin, err)
	}
	return out.String(), errOut.String(), code
}

// identityEnv is a capture with its embedded broker on url, its slot and
// publication named name, every table of the database.
func identityEnv(t *testing.T, url, name string) (env []string, listen, metrics, dataDir string) {
	t.Helper()
	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	metrics, err = bench.LocalAddr()
	require.NoError(t, err)
	dataDir = t.TempDir()
	return []string{"EPITAPH_SOURCE_URL=" + url, "EPITAPH_NATS_URL=", "EPITAPH_NATS_LISTEN=" + listen,
		"EPITAPH_DATA_DIR=" + dataDir, "EPITAPH_METRICS_ADDR=" + metrics, "EPITAPH_SLOT=" + name,
		"EPITAPH_PUBLICATION=" + name, "EPITAPH_TABLES=", "EPITAPH_PARTITIONS=2", "EPITAPH_HEARTBEAT_INTERVAL=1s"}, listen, metrics, dataDir
}

func relReplIdent(t *testing.T, url, table string) string {
	t.Helper()
	var id string
	require.NoError(t, queryRow(url, `SELECT relreplident::text FROM pg_class WHERE oid = $1::regclass`, []any{table}, &id))
	return id
}

func queryRow(url, sql string, args []any, dst ...any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(ctx, sql, args...).Scan(dst...)
}

// slotAndPublication counts the slot and the publication called name.
func slotAndPublication(t *testing.T, url, name string) (slots, pubs int) {
	t.Helper()
	require.NoError(t, queryRow(url, `SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1),
		(SELECT count(*) FROM pg_publication WHERE pubname = $1)`, []any{name}, &slots, &pubs))
	return slots, pubs
}

// firstDelete reads the first delete event of the stream of source main.
func firstDelete(t *testing.T, ctx context.Context, watch *bench.StreamWatch) *event.Event {
	t.Helper()
	c, err := watch.JetStream().OrderedConsumer(ctx, event.StreamName("main"), jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{event.SubjectPrefix + ".main.*.delete.>"}})
	require.NoError(t, err)
	msg, err := c.Next(jetstream.FetchMaxWait(30 * time.Second))
	require.NoError(t, err)
	ev, err := event.Decode(msg.Data())
	require.NoError(t, err)
	return ev
}

// TestKeyOnlyTablesAreRefused: the real capture, on a database with a
// table that is not REPLICA IDENTITY FULL and given neither way out,
// exits 2 with one line naming that table (not the FULL one) and both
// flags, and has created neither slot nor publication nor changed the
// table. With --allow-key-only it captures the table's deletes as keys.
func TestKeyOnlyTablesAreRefused(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE public.orders (id int PRIMARY KEY, total numeric);
		CREATE TABLE public.notes (id int PRIMARY KEY, body text); ALTER TABLE public.notes REPLICA IDENTITY FULL;
		INSERT INTO public.orders VALUES (1, 9.50), (2, 3.25)`)
	env, listen, metrics, dataDir := identityEnv(t, url, "epitaph_keyonly")

	_, stderr, code := runCapture(t, bins["capture"], env)
	require.Equal(t, 2, code, stderr)
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	last := lines[len(lines)-1]
	require.True(t, strings.HasPrefix(last, "capture: tables without REPLICA IDENTITY FULL"), stderr)
	require.Contains(t, last, "public.orders")
	require.NotContains(t, last, "public.notes")
	require.Contains(t, last, "--set-replica-identity-full")
	require.Contains(t, last, "--allow-key-only")
	slots, pubs := slotAndPublication(t, url, "epitaph_keyonly")
	require.Zero(t, slots, "no slot after the refusal")
	require.Zero(t, pubs, "no publication after the refusal")
	require.Equal(t, "d", relReplIdent(t, url, "public.orders"))

	// The way out that keeps keys only, by its variable.
	cp, err := bench.StartProc("capture", bins["capture"], append(env, "EPITAPH_ALLOW_KEY_ONLY=true"), t.TempDir())
	require.NoError(t, err)
	defer cp.Kill()
	waitHealthy(t, "http://"+metrics+"/readyz", cp)
	require.Equal(t, "d", relReplIdent(t, url, "public.orders"), "--allow-key-only changes no table")
	testenv.Exec(t, url, `DELETE FROM public.orders WHERE id = 2`)
	watch, err := bench.WatchStream("nats://"+listen, "main", bench.EmbeddedCreds(dataDir))
	require.NoError(t, err)
	defer watch.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ev := firstDelete(t, ctx, watch)
	require.Equal(t, "orders", ev.Table)
	require.Equal(t, event.IdentityKey, ev.Identity)
	require.JSONEq(t, `{"id":2}`, string(ev.Key))
	require.JSONEq(t, `{"id":2}`, string(ev.Row), "the key columns only, no total")
	require.NoError(t, cp.Stop(30*time.Second))
}

// TestSetFullThenUninstall: the other way out, --set-replica-identity-full,
// makes every table FULL (recording what each was) and captures whole
// rows; `capture uninstall` refuses while the capture streams, prints its
// plan and changes nothing without --yes, and with it leaves no slot, no
// publication and every identity as it was before (pg_class.relreplident,
// the replica identity index too), a table FULL before untouched.
func TestSetFullThenUninstall(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE public.orders (id int PRIMARY KEY, note text);
		CREATE TABLE public.lines (order_id int, sku text); ALTER TABLE public.lines REPLICA IDENTITY NOTHING;
		CREATE TABLE public.codes (id int NOT NULL, code text NOT NULL UNIQUE); ALTER TABLE public.codes REPLICA IDENTITY USING INDEX codes_code_key;
		CREATE TABLE public.notes (id int PRIMARY KEY, body text); ALTER TABLE public.notes REPLICA IDENTITY FULL;
		INSERT INTO public.orders VALUES (1, 'first'), (2, 'second')`)
	const name = "epitaph_uninstall"
	env, listen, metrics, dataDir := identityEnv(t, url, name)
	cp, err := bench.StartProc("capture", bins["capture"], append(env, "EPITAPH_SET_REPLICA_IDENTITY_FULL=true"), t.TempDir())
	require.NoError(t, err)
	defer cp.Kill()
	waitHealthy(t, "http://"+metrics+"/readyz", cp)
	for _, table := range []string{"public.orders", "public.lines", "public.codes", "public.notes"} {
		require.Equal(t, "f", relReplIdent(t, url, table), table)
	}
	testenv.Exec(t, url, `DELETE FROM public.orders WHERE id = 2`)
	watch, err := bench.WatchStream("nats://"+listen, "main", bench.EmbeddedCreds(dataDir))
	require.NoError(t, err)
	defer watch.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ev := firstDelete(t, ctx, watch)
	require.Equal(t, event.IdentityFull, ev.Identity)
	require.JSONEq(t, `{"id":2,"note":"second"}`, string(ev.Row), "the whole row")

	source := []string{"EPITAPH_SOURCE_URL=" + url, "EPITAPH_SLOT=" + name, "EPITAPH_PUBLICATION=" + name}
	_, stderr, code := runCapture(t, bins["capture"], source, "uninstall", "--yes")
	require.Equal(t, 1, code, stderr)
	require.Contains(t, stderr, "is in use by process", "refused while the capture streams")
	require.NoError(t, cp.Stop(30*time.Second))

	stdout, stderr, code := runCapture(t, bins["capture"], source, "uninstall")
	require.Equal(t, 2, code, stderr)
	require.Contains(t, stderr, "run again with --yes")
	for _, want := range []string{
		`DROP PUBLICATION "epitaph_uninstall";`,
		`SELECT pg_drop_replication_slot('epitaph_uninstall');`,
		`ALTER TABLE "public"."orders" REPLICA IDENTITY DEFAULT;`,
		`ALTER TABLE "public"."lines" REPLICA IDENTITY NOTHING;`,
		`ALTER TABLE "public"."codes" REPLICA IDENTITY USING INDEX "codes_code_key";`,
	} {
		require.Contains(t, stdout, want)
	}
	require.NotContains(t, stdout, `"notes"`, "FULL before the capture: not the capture's to put back")
	slots, pubs := slotAndPublication(t, url, name)
	require.Equal(t, []int{1, 1}, []int{slots, pubs}, "nothing done without --yes")
	require.Equal(t, "f", relReplIdent(t, url, "public.orders"))

	stdout, stderr, code = runCapture(t, bins["capture"], source, "uninstall", "--yes")
	require.Equal(t, 0, code, stdout+stderr)
	slots, pubs = slotAndPublication(t, url, name)
	require.Zero(t, slots, "slot dropped")
	require.Zero(t, pubs, "publication dropped")
	for table, want := range map[string]string{"public.orders": "d", "public.lines": "n", "public.codes": "i", "public.notes": "f"} {
		require.Equal(t, want, relReplIdent(t, url, table), table)
	}
	var idx string
	require.NoError(t, queryRow(url, `SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = 'public.codes'::regclass AND indisreplident`, nil, &idx))
	require.Equal(t, "codes_code_key", idx)
	var schemaLeft bool
	require.NoError(t, queryRow(url, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'epitaph_capture')`, nil, &schemaLeft))
	require.False(t, schemaLeft, "the capture's record is gone with the rest")

	// Again: nothing left to do, and it says so.
	stdout, _, code = runCapture(t, bins["capture"], source, "uninstall", "--yes")
	require.Equal(t, 0, code)
	require.Contains(t, stdout, "(nothing to do)")
}
