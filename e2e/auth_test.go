package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	osexec "os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
	"github.com/epitaph-dev/epitaph/progress"
)

func httpBody(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err, url)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

func waitHealthy(t *testing.T, url string, p *bench.Proc) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if done, err := p.Exited(); done {
			t.Fatalf("%s exited (%v) before %s was healthy:\n%s", p.Name, err, url, p.LogTail(3000))
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not healthy after 2m:\n%s", url, p.LogTail(3000))
		}
		time.Sleep(100 * time.Millisecond) // polling with a deadline
	}
}

// TestEmbeddedBrokerRefusesOutsideWriters runs the real capture with its
// embedded broker: a client without credentials is refused, a client with
// the projector's credentials is refused a publish to the stream (which
// stays as the capture wrote it), and the real projector with those
// credentials (--nats-creds, as the capture's log says) archives every
// deleted row with its values.
func TestEmbeddedBrokerRefusesOutsideWriters(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE items (id int PRIMARY KEY, v text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, 'item ' || i FROM generate_series(1, 20) i`)
	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	logs := t.TempDir()
	cp, err := bench.StartProc("capture", bins["capture"], []string{"EPITAPH_SOURCE_URL=" + url, "EPITAPH_NATS_URL=",
		"EPITAPH_NATS_LISTEN=" + listen, "EPITAPH_DATA_DIR=" + dataDir, "EPITAPH_METRICS_ADDR=" + metrics,
		"EPITAPH_SLOT=epitaph_auth", "EPITAPH_PUBLICATION=epitaph_auth", "EPITAPH_TABLES=public.items", "EPITAPH_PARTITIONS=2"}, logs)
	require.NoError(t, err)
	defer cp.Kill()
	waitHealthy(t, "http://"+metrics+"/healthz", cp)

	credsDir := capture.EmbeddedCredsDir(dataDir)
	projectorCreds := broker.ProjectorCreds(credsDir)
	log, err := os.ReadFile(cp.LogPath)
	require.NoError(t, err)
	require.Contains(t, string(log), "projector_creds="+projectorCreds, "the capture says where the projector's credentials are")
	raw, err := os.ReadFile(projectorCreds)
	require.NoError(t, err)
	for _, line := range strings.Split(string(raw), "\n") {
		if line = strings.TrimSpace(line); len(line) > 20 && !strings.HasPrefix(line, "-----") {
			require.NotContains(t, string(log), line, "a credential's content in the capture's log")
		}
	}

	natsURL := "nats://" + listen
	_, err = natsgo.Connect(natsURL)
	require.ErrorIs(t, err, natsgo.ErrAuthorization, "no credentials")

	pnc, err := natsgo.Connect(natsURL, natsconn.UserCredentials(projectorCreds))
	require.NoError(t, err)
	defer pnc.Close()
	pjs, err := jetstream.New(pnc)
	require.NoError(t, err)
	stream, err := pjs.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	forged := `{"v":1,"op":"delete","source":"main","schema":"public","table":"items","xid":1,"commit_lsn":"0/1","seq":0,"identity":"full","key":{"id":1},"row":{"id":1,"v":"forged"}}`
	pctx, pcancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = pjs.PublishMsg(pctx, &natsgo.Msg{Subject: event.DeleteSubject("main", 0, "public", "items"), Data: []byte(forged),
		Header: natsgo.Header{natsgo.MsgIdHdr: []string{"main/0/1/0"}}})
	pcancel()
	require.Error(t, err, "the projector's credentials publish to the stream")

	// A projector without the credentials stops with a line that says why.
	nm, err := bench.LocalAddr()
	require.NoError(t, err)
	np, err := bench.StartProc("projector-nocreds", bins["projector"], []string{"EPITAPH_TARGET_URL=" + url, "EPITAPH_NATS_URL=" + natsURL,
		"EPITAPH_METRICS_ADDR=" + nm, "EPITAPH_WORKER_ID=auth-0"}, logs, "run")
	require.NoError(t, err)
	defer np.Kill()
	select {
	case <-np.Done():
	case <-time.After(2 * time.Minute):
		t.Fatalf("a projector without credentials keeps running:\n%s", np.LogTail(3000))
	}
	exited, perr := np.Exited()
	require.True(t, exited)
	require.Error(t, perr, "it exits non-zero")
	tail := np.LogTail(3000)
	require.Contains(t, tail, "projector: NATS connection to nats://"+listen+" closed: nats: Authorization Violation", tail)
	require.Contains(t, tail, "--nats-creds <its data dir>/nats/projector.creds", tail)

	testenv.Exec(t, url, `DELETE FROM items WHERE id <= 10`)
	testenv.Exec(t, url, `DELETE FROM items WHERE id > 15`)

	pm, err := bench.LocalAddr()
	require.NoError(t, err)
	pp, err := bench.StartProc("projector", bins["projector"], []string{"EPITAPH_TARGET_URL=" + url, "EPITAPH_NATS_URL=" + natsURL,
		"EPITAPH_METRICS_ADDR=" + pm, "EPITAPH_WORKER_ID=auth-1"}, logs, "run", "--nats-creds", projectorCreds)
	require.NoError(t, err)
	defer pp.Kill()
	waitHealthy(t, "http://"+pm+"/healthz", pp)

	type row struct {
		id int
		v  string
	}
	var got []row
	err = workload.WaitFor(ctx, 2*time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE table_name = 'items'`)
		return n >= 15, err
	})
	require.NoError(t, err, "archive:\n%s", pp.LogTail(3000))
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT (row->>'id')::int, row->>'v' FROM archive.rows WHERE table_name = 'items' ORDER BY 1`)
	require.NoError(t, err)
	for rows.Next() {
		var r row
		require.NoError(t, rows.Scan(&r.id, &r.v))
		got = append(got, r)
	}
	require.NoError(t, rows.Err())
	var want []row
	for i := 1; i <= 20; i++ {
		if i <= 10 || i > 15 {
			want = append(want, row{i, fmt.Sprintf("item %d", i)})
		}
	}
	require.Equal(t, want, got, "every deleted row once, real values, no forgery")

	// Holders of the running roles' real credentials, while the pipeline
	// runs, try what the role may not do (the running projector's consumer
	// is the victim): the server refuses every attempt.
	var victims []string
	vrows, err := conn.Query(ctx, `SELECT consumer FROM epitaph.progress WHERE projection = 'archive' AND consumer IS NOT NULL ORDER BY partition`)
	require.NoError(t, err)
	for vrows.Next() {
		var c string
		require.NoError(t, vrows.Scan(&c))
		victims = append(victims, c)
	}
	require.NoError(t, vrows.Err())
	require.Len(t, victims, 2, "one consumer a partition")
	proj := testenv.NewAttacker(t, natsURL, natsconn.UserCredentials(projectorCreds))
	proj.RequireRefused(t, ctx, proj.ProjectorAttempts("main", victims[0], 1))
	capt := testenv.NewAttacker(t, natsURL, natsconn.UserCredentials(broker.CaptureCreds(credsDir)))
	capt.RequireRefused(t, ctx, capt.CaptureAttempts("main", victims[1], 1))

	// Another target's own credentials, made by the real capture creds
	// while the capture's broker runs, and the capture's: answered on
	// their own inboxes, they cannot read the running projector's inboxes,
	// acknowledgements or advisories, list its consumers or find them under
	// the names consumers had before they carried a random part.
	otherCreds := broker.TargetCreds(credsDir, "other")
	cout, err := osexec.CommandContext(ctx, bins["capture"], "creds", "--target", "other", "--data-dir", dataDir).CombinedOutput()
	require.NoError(t, err, string(cout))
	require.Contains(t, string(cout), "wrote "+otherCreds)
	group := strings.SplitN(victims[0], "_", 2)[0]
	other := testenv.NewAttacker(t, natsURL, natsconn.UserCredentials(otherCreds))
	for who, att := range map[string]*testenv.Attacker{"other target": other, "capture": capt} {
		_, err := att.JS.AccountInfo(ctx)
		require.NoError(t, err, who)
		att.RequireRefused(t, ctx, append(att.SnoopAttempts("main", broker.ProjectorUser), att.ListConsumers("main")))
		for p := range victims {
			k := progress.Key{Projection: "archive", Version: 1, Partition: p}
			for _, guess := range []string{k.GroupConsumerName(group), k.ConsumerName()} {
				_, err := att.JS.Consumer(ctx, event.StreamName("main"), guess)
				require.ErrorIs(t, err, jetstream.ErrConsumerNotFound, "%s finds %s", who, guess)
			}
		}
	}

	// What a holder of the projector's credentials who also reads the
	// target's database (the recorded names) may do: delete its consumers
	// and make them anew under the same names, filters and limits,
	// delivering headers only. The running projector resets them
	// at its cursors; the rows deleted next are archived once each, with
	// their values, nothing quarantined as malformed.
	for _, name := range victims {
		c, err := proj.JS.Consumer(ctx, event.StreamName("main"), name)
		require.NoError(t, err)
		hijack := c.CachedInfo().Config
		hijack.HeadersOnly = true
		hijack.DeliverPolicy, hijack.OptStartSeq = jetstream.DeliverAllPolicy, 0
		require.NoError(t, proj.JS.DeleteConsumer(ctx, event.StreamName("main"), name))
		_, err = proj.JS.CreateConsumer(ctx, event.StreamName("main"), hijack)
		require.NoError(t, err)
	}
	for i := 11; i <= 15; i++ {
		testenv.Exec(t, url, fmt.Sprintf(`DELETE FROM items WHERE id = %d`, i))
	}
	err = workload.WaitFor(ctx, 2*time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE table_name = 'items'`)
		return n >= 20, err
	})
	require.NoError(t, err, "archive after the hijack:\n%s", pp.LogTail(3000))
	got = nil
	rows, err = conn.Query(ctx, `SELECT (row->>'id')::int, row->>'v' FROM archive.rows WHERE table_name = 'items' ORDER BY 1`)
	require.NoError(t, err)
	for rows.Next() {
		var r row
		require.NoError(t, rows.Scan(&r.id, &r.v))
		got = append(got, r)
	}
	require.NoError(t, rows.Err())
	want = nil
	for i := 1; i <= 20; i++ {
		want = append(want, row{i, fmt.Sprintf("item %d", i)})
	}
	require.Equal(t, want, got, "every deleted row once, despite the attempts and the hijack")
	n, err := bench.Count(ctx, url, `SELECT count(*) FROM epitaph.quarantine`)
	require.NoError(t, err)
	require.Zero(t, n, "nothing quarantined")
	for _, name := range victims {
		c, err := proj.JS.Consumer(ctx, event.StreamName("main"), name)
		require.NoError(t, err)
		require.False(t, c.CachedInfo().Config.HeadersOnly, "the projector made %s anew", name)
	}

	after, err := stream.Info(ctx)
	require.NoError(t, err)
	require.Positive(t, after.State.LastSeq)
	for seq := uint64(1); seq <= after.State.LastSeq; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		require.NoError(t, err)
		require.NotContains(t, string(m.Data), "forged", "sequence %d", seq)
	}

	// erase --purge-stream with the projector's credentials is refused
	// before it erases anything (exit 3: the row still archived, no
	// erasure recorded, its message still in the stream); with the erase
	// role's it erases and purges.
	erase := func(creds string) (string, int) {
		cmd := osexec.CommandContext(ctx, bins["projector"], "erase", "--table", "public.items", "--key", `{"id":3}`,
			"--purge-stream", "--reason", "test", "--yes", "--nats-creds", creds)
		cmd.Env = append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_NATS_URL="+natsURL, "EPITAPH_METRICS_ADDR=")
		out, err := cmd.CombinedOutput()
		var ee *osexec.ExitError
		if errors.As(err, &ee) {
			return string(out), ee.ExitCode()
		}
		require.NoError(t, err, string(out))
		return string(out), 0
	}
	inStream := func() int {
		n := 0
		for seq := uint64(1); seq <= after.State.LastSeq; seq++ {
			if m, err := stream.GetMsg(ctx, seq); err == nil && strings.Contains(string(m.Data), `"item 3"`) {
				n++
			}
		}
		return n
	}
	require.Equal(t, 1, inStream())
	out, code := erase(projectorCreds)
	require.Equal(t, 3, code, out)
	require.Contains(t, out, "nothing was erased", out)
	n, err = bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE table_name = 'items' AND key = '{"id":3}'`)
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "the refused erase erased nothing")
	n, err = bench.Count(ctx, url, `SELECT count(*) FROM epitaph.erasures`)
	require.NoError(t, err)
	require.Zero(t, n, "no erasure recorded")
	require.Equal(t, 1, inStream())
	out, code = erase(broker.EraseCreds(credsDir))
	require.Equal(t, 0, code, out)
	n, err = bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE table_name = 'items' AND key = '{"id":3}'`)
	require.NoError(t, err)
	require.Zero(t, n, "erased")
	require.Zero(t, inStream(), "purged from the stream")
}
