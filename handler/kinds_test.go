package handler

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestWebhook(t *testing.T) {
	e := newTenv(t)
	secretFile := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secretFile, []byte("s3cret\n"), 0o600))
	type call struct {
		id, attempt, sig string
		body             []byte
		header           http.Header
	}
	var mu sync.Mutex
	var calls []call
	// key 1: 503 twice then 200; key 2: 429 then 204; key 3: 404 (permanent); key 4: 200.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		calls = append(calls, call{r.Header.Get(HeaderDeliveryID), r.Header.Get(HeaderAttempt), r.Header.Get(HeaderSignature), b, r.Header.Clone()})
		mu.Unlock()
		var body Body
		_ = json.Unmarshal(b, &body)
		var k struct{ ID int }
		_ = json.Unmarshal(body.Key, &k)
		a, _ := strconv.Atoi(r.Header.Get(HeaderAttempt))
		switch {
		case k.ID == 1 && a <= 2:
			w.WriteHeader(503)
			_, _ = w.Write([]byte("RESPONSE-BODY-NEVER-STORED"))
		case k.ID == 2 && a == 1:
			w.WriteHeader(429)
		case k.ID == 2:
			w.WriteHeader(204)
		case k.ID == 3:
			w.WriteHeader(404)
			_, _ = w.Write([]byte("RESPONSE-BODY-NEVER-STORED"))
		default:
			w.WriteHeader(200)
		}
	}))
	defer srv.Close()
	h := e.addHandler(KindWebhook, srv.URL+"/hook", func(d *Def) { d.SecretFile = secretFile; d.Columns = []string{"blob"} })
	e.enqueue(1, e.row(1), e.row(2), e.row(3), e.row(4))
	e.flush(e.dispatcher(Config{}))
	ds := e.deliveries()
	require.Equal(t, []string{StateDone, StateDone, StateDead, StateDone}, []string{ds[0].State, ds[1].State, ds[2].State, ds[3].State})
	require.Equal(t, []int{3, 2, 1, 1}, []int{ds[0].Attempt, ds[1].Attempt, ds[2].Attempt, ds[3].Attempt})
	require.Contains(t, *ds[2].LastError, "code=http_404")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, calls, 7)
	// The old raw secret signs both ways: the deprecated header, and
	// webhook-signature with its bytes as the key (whsec_ of their base64
	// is the same secret to a standard verifier).
	raw, err := standardwebhooks.NewWebhookRaw([]byte("s3cret"))
	require.NoError(t, err)
	std, err := standardwebhooks.NewWebhook(FormatSecret([]byte("s3cret")))
	require.NoError(t, err)
	for _, c := range calls {
		require.Equal(t, Sign([]byte("s3cret"), c.body), c.sig, "HMAC-SHA256 of the body")
		require.NoError(t, raw.Verify(c.body, c.header))
		require.NoError(t, std.Verify(c.body, c.header))
		var b Body
		require.NoError(t, json.Unmarshal(c.body, &b))
		require.Equal(t, c.id, b.DeliveryID)
		require.NotContains(t, string(c.body), "attempt", "the attempt is in a header only")
		require.Equal(t, h.ID, b.HandlerID)
		require.Equal(t, "public.orders", b.Table)
		require.NotEmpty(t, b.CorrelationID)
		require.NotNil(t, b.CommitTime)
		require.Len(t, b.Columns, 1, "only the kept columns")
		require.Contains(t, string(b.Columns["blob"]), "b-")
	}
	var n int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM epitaph.deliveries d WHERE d::text LIKE '%RESPONSE-BODY%'`).Scan(&n))
	require.Zero(t, n)
	require.NotContains(t, e.logs.String(), "RESPONSE-BODY")
}

func TestWebhookTimeoutRetries(t *testing.T) {
	e := newTenv(t)
	var mu sync.Mutex
	n := 0
	stop := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		mu.Lock()
		n++
		first := n == 1
		mu.Unlock()
		if first {
			select { // hangs until the client gives up
			case <-r.Context().Done():
			case <-stop:
			}
			return
		}
		w.WriteHeader(200)
	}))
	defer srv.Close()
	defer close(stop)
	e.addHandler(KindWebhook, srv.URL, func(d *Def) { d.ClaimTimeout = time.Second })
	e.enqueue(1, e.row(1))
	e.flush(e.dispatcher(Config{}))
	ds := e.deliveries()
	require.Equal(t, StateDone, ds[0].State)
	require.Equal(t, 2, ds[0].Attempt)
	require.Contains(t, *ds[0].LastError, "code=deadline_exceeded")
}

func TestExec(t *testing.T) {
	e := newTenv(t)
	dir := t.TempDir()
	script := filepath.Join(dir, "h.sh")
	// Writes stdin to a file per delivery; key 1 asks for a retry once,
	// key 2 fails with 3.
	require.NoError(t, os.WriteFile(script, []byte(`#!/bin/sh
body=$(cat)
id=$(printf '%s' "$body" | sed 's/.*"delivery_id":"\([^"]*\)".*/\1/')
case "$body" in
  *'"key":{"id":1}'*) if [ ! -e "$1/$id.retried" ]; then touch "$1/$id.retried"; exit 75; fi ;;
  *'"key":{"id":2}'*) echo "EXEC-OUTPUT-NEVER-STORED" >&2; exit 3 ;;
esac
printf '%s' "$body" > "$1/$id.json"
`), 0o755))
	target, _ := json.Marshal([]string{script, dir})
	e.addHandler(KindExec, string(target))
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	e.flush(e.dispatcher(Config{}))
	ds := e.deliveries()
	require.Equal(t, StateDone, ds[0].State)
	require.Equal(t, 2, ds[0].Attempt)
	require.Equal(t, StateDead, ds[1].State)
	require.Contains(t, *ds[1].LastError, "code=exit_3")
	require.Equal(t, StateDone, ds[2].State)
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	require.NoError(t, err)
	require.Len(t, files, 2)
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		var body Body
		require.NoError(t, json.Unmarshal(b, &body), "the JSON body on stdin")
		require.Equal(t, filepath.Base(f), body.DeliveryID+".json")
	}
	require.NotContains(t, e.logs.String(), "EXEC-OUTPUT")
}

func TestExecTargetIsValidated(t *testing.T) {
	for _, bad := range []string{"rm -rf /", `[]`, `[""]`, `{"a":1}`} {
		d := Def{ID: newUUID(), Schema: "public", Table: "t", Kind: KindExec, Target: bad, MaxAttempts: 1, Backoff: time.Second, ClaimTimeout: time.Second}
		require.Error(t, d.Validate(), bad)
	}
}

func TestNATSPublishWithMsgID(t *testing.T) {
	e := newTenv(t)
	n := testenv.NewNATS(t)
	nc, js := n.Connect(t)
	defer nc.Close()
	ctx := context.Background()
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "PURGES", Subjects: []string{"purges.>"}, Duplicates: time.Hour})
	require.NoError(t, err)
	def := e.addHandler(KindNATS, "purges.orders")
	e.enqueue(1, e.row(1), e.row(2))
	d := e.dispatcher(Config{JetStream: js})
	e.flush(d)
	// A second publish of the same delivery (a retry) is deduplicated.
	var id string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT id::text FROM epitaph.deliveries ORDER BY key->>'id' LIMIT 1`).Scan(&id))
	require.NoError(t, d.run.run(ctx, def, Delivery{ID: id, HandlerID: def.ID, Attempt: 2}))
	info, err := js.Stream(ctx, "PURGES")
	require.NoError(t, err)
	si, err := info.Info(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 2, si.State.Msgs, "one message per delivery id")
	for seq := uint64(1); seq <= 2; seq++ {
		m, err := info.GetMsg(ctx, seq)
		require.NoError(t, err)
		var b Body
		require.NoError(t, json.Unmarshal(m.Data, &b))
		require.Equal(t, b.DeliveryID, m.Header.Get(jetstream.MsgIDHeader))
	}
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
	}
}

// A webhook secret is read from its file once a second at most: a
// rotated secret is used once the cached copy is a second old, and a
// failed read is not cached (the next attempt reads the file again).
func TestSecretCacheRereadsARotatedSecret(t *testing.T) {
	file := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(file, []byte("first\r\n"), 0o600))
	var c secretCache
	get := func() (string, error) {
		s, err := c.get(file)
		if err != nil {
			return "", err
		}
		return string(s[0].Key), nil
	}
	got, err := get()
	require.NoError(t, err)
	require.Equal(t, "first", got, "trailing line break trimmed")
	require.NoError(t, os.WriteFile(file, []byte("second\n"), 0o600))
	got, err = get()
	require.NoError(t, err)
	require.Equal(t, "first", got, "younger than a second: the cached copy")
	age := func() {
		c.mu.Lock()
		s := c.m[file]
		s.at = s.at.Add(-secretMaxAge)
		c.m[file] = s
		c.mu.Unlock()
	}
	age()
	got, err = get()
	require.NoError(t, err)
	require.Equal(t, "second", got, "a second old: read again")
	require.NoError(t, os.Remove(file))
	age()
	_, err = get()
	require.Error(t, err, "a secret file gone is an error, not the old secret")
	require.NoError(t, os.WriteFile(file, []byte("third"), 0o600))
	got, err = get()
	require.NoError(t, err)
	require.Equal(t, "third", got, "the failed read was not cached")
}
