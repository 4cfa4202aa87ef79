package handler

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"
)

// receiver is a webhook endpoint that verifies every request with the
// Standard Webhooks library (each of verifiers must accept it) and
// records it; answer decides the response from the key and the number
// of requests for it so far, this one included (0: hang until the client
// gives up).
type receiver struct {
	t         *testing.T
	verifiers map[string]*standardwebhooks.Webhook
	answer    func(key, n int) int
	seen      map[int]int
	mu        sync.Mutex
	reqs      []request
	bad       []string
	stop      chan struct{}
}

type request struct {
	id, deliveryID, timestamp string
	attempt, key              int
	sigs                      []string
	body                      []byte
	at                        time.Time
}

func newReceiver(t *testing.T, verifiers map[string]*standardwebhooks.Webhook, answer func(key, n int) int) (*receiver, *httptest.Server) {
	rc := &receiver{t: t, verifiers: verifiers, answer: answer, seen: map[int]int{}, stop: make(chan struct{})}
	srv := httptest.NewServer(rc)
	t.Cleanup(func() { close(rc.stop); srv.Close() })
	return rc, srv
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	q := request{id: r.Header.Get("webhook-id"), deliveryID: r.Header.Get(HeaderDeliveryID),
		timestamp: r.Header.Get("webhook-timestamp"), sigs: strings.Fields(r.Header.Get("webhook-signature")), body: body, at: time.Now()}
	q.attempt, _ = strconv.Atoi(r.Header.Get(HeaderAttempt))
	var b Body
	var k struct{ ID int }
	if json.Unmarshal(body, &b) == nil {
		_ = json.Unmarshal(b.Key, &k)
	}
	q.key = k.ID
	rc.mu.Lock()
	for name, v := range rc.verifiers {
		// Verify checks the timestamp too: within five minutes of now.
		if err := v.Verify(body, r.Header); err != nil {
			rc.bad = append(rc.bad, name+": "+err.Error())
		}
	}
	rc.reqs = append(rc.reqs, q)
	rc.seen[q.key]++
	n, bad := rc.seen[q.key], len(rc.bad) > 0
	rc.mu.Unlock()
	if bad {
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	code := rc.answer(q.key, n)
	if code == 0 {
		select { // hangs until the client gives up
		case <-r.Context().Done():
		case <-rc.stop:
		}
		return
	}
	w.WriteHeader(code)
}

func (rc *receiver) requests() []request {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	require.Empty(rc.t, rc.bad, "every request verifies")
	return append([]request(nil), rc.reqs...)
}

func writeSecret(t *testing.T, lines ...string) string {
	file := filepath.Join(t.TempDir(), "hook.secret")
	require.NoError(t, os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o600))
	return file
}

func verifier(t *testing.T, secret string) *standardwebhooks.Webhook {
	wh, err := standardwebhooks.NewWebhook(secret)
	require.NoError(t, err)
	return wh
}

// Every request of a webhook with a whsec_ secret verifies with the
// standard library, through failures, a hang past the deadline and
// success; a delivery's body is byte-identical on every attempt, its
// webhook-id is the delivery id, its timestamp the attempt's.
func TestWebhookStandardSignatureUnderRetries(t *testing.T) {
	e := newTenv(t)
	secret := NewSecret()
	// By the requests for a key: key 1: 503 twice, then 200; key 2: hangs
	// once, then 204; key 3: 503, a hang, then 200; key 4: 200.
	rc, srv := newReceiver(t, map[string]*standardwebhooks.Webhook{"secret": verifier(t, secret)}, func(key, n int) int {
		switch {
		case key == 1 && n <= 2, key == 3 && n == 1:
			return 503
		case key == 2 && n == 1, key == 3 && n == 2:
			return 0
		case key == 2:
			return 204
		}
		return 200
	})
	e.addHandler(KindWebhook, srv.URL+"/hook", func(d *Def) {
		d.SecretFile = writeSecret(t, secret)
		d.Columns = []string{"blob"}
		d.ClaimTimeout = time.Second
	})
	start := time.Now().Add(-time.Second)
	e.enqueue(1, e.row(1), e.row(2), e.row(3), e.row(4))
	e.flush(e.dispatcher(Config{}))
	ds := e.deliveries()
	// A claim of Flush's next batch can expire while the hang holds the
	// current one (its reclaim is an attempt, never sent): attempts are
	// at least the requests.
	for i, want := range []int{3, 2, 3, 1} {
		require.Equal(t, StateDone, ds[i].State, "key %d", i+1)
		require.GreaterOrEqual(t, ds[i].Attempt, want, "key %d", i+1)
	}
	require.Contains(t, *ds[1].LastError, "code=deadline_exceeded", "the hang ran past the deadline")
	reqs := rc.requests()
	require.Len(t, reqs, 9)
	bodies := map[int][]byte{}
	attempts := map[int][]int{}
	for _, q := range reqs {
		require.NotZero(t, q.key)
		require.Equal(t, q.deliveryID, q.id, "webhook-id is the delivery id")
		require.Len(t, q.sigs, 1, "one secret, one signature")
		require.True(t, strings.HasPrefix(q.sigs[0], "v1,"))
		ts, err := strconv.ParseInt(q.timestamp, 10, 64)
		require.NoError(t, err)
		require.GreaterOrEqual(t, ts, start.Unix())
		require.LessOrEqual(t, ts, q.at.Unix(), "the attempt's own time")
		var b Body
		require.NoError(t, json.Unmarshal(q.body, &b))
		require.Equal(t, q.id, b.DeliveryID)
		if first, ok := bodies[q.key]; ok {
			require.Equal(t, string(first), string(q.body), "key %d attempt %d: the same bytes", q.key, q.attempt)
		} else {
			bodies[q.key] = q.body
		}
		attempts[q.key] = append(attempts[q.key], q.attempt)
	}
	counts := map[int]int{}
	for k, as := range attempts {
		counts[k] = len(as)
		for i := 1; i < len(as); i++ {
			require.Greater(t, as[i], as[i-1], "key %d: Epitaph-Attempt grows: %v", k, as)
		}
		require.Equal(t, ds[k-1].Attempt, as[len(as)-1], "key %d: the last request was the last attempt", k)
	}
	require.Equal(t, map[int]int{1: 3, 2: 2, 3: 3, 4: 1}, counts)
	require.Len(t, bodies, 4)
	// The receiver's check can fail: another secret does not verify.
	q := reqs[0]
	h := http.Header{}
	h.Set("webhook-id", q.id)
	h.Set("webhook-timestamp", q.timestamp)
	h.Set("webhook-signature", strings.Join(q.sigs, " "))
	require.NoError(t, verifier(t, secret).Verify(q.body, h))
	require.ErrorIs(t, verifier(t, NewSecret()).Verify(q.body, h), standardwebhooks.ErrNoMatchingSignature)
	require.Error(t, verifier(t, secret).Verify(append([]byte(" "), q.body...), h), "a changed body")
}

// During a rotation every request carries two signatures, and a receiver
// holding either secret verifies it; before, only the old one does; once
// the window has ended, only the new one.
func TestWebhookSecretRotationSignsWithBoth(t *testing.T) {
	e := newTenv(t)
	old, next := NewSecret(), NewSecret()
	file := writeSecret(t, old)
	oldV, nextV := verifier(t, old), verifier(t, next)
	rc, srv := newReceiver(t, nil, func(int, int) int { return 200 })
	e.addHandler(KindWebhook, srv.URL, func(d *Def) { d.SecretFile = file })

	e.enqueue(1, e.row(1))
	e.flush(e.dispatcher(Config{}))
	nextFile := writeSecret(t, next)
	until, err := RotateSecretFile(file, mustRead(t, nextFile), time.Hour, time.Now())
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(time.Hour), until, 2*time.Second)
	st, err := os.Stat(file)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), "the file's mode kept")
	lines := strings.Split(strings.TrimSpace(mustRead(t, file)), "\n")
	require.Equal(t, []string{next, old + " until=" + until.UTC().Format(time.RFC3339)}, lines)

	e.enqueue(1, e.row(2))
	e.flush(e.dispatcher(Config{})) // a new dispatcher: no cached secret
	// The window over (rewritten as if it had passed): the old one is
	// still in the file but signs no more.
	require.NoError(t, os.WriteFile(file, []byte(next+"\n"+old+" until="+time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)+"\n"), 0o600))
	e.enqueue(1, e.row(3))
	e.flush(e.dispatcher(Config{}))

	reqs := rc.requests()
	require.Len(t, reqs, 3)
	verifies := func(v *standardwebhooks.Webhook, q request) bool {
		h := http.Header{}
		h.Set("webhook-id", q.id)
		h.Set("webhook-timestamp", q.timestamp)
		h.Set("webhook-signature", strings.Join(q.sigs, " "))
		return v.Verify(q.body, h) == nil
	}
	byKey := map[int]request{}
	for _, q := range reqs {
		byKey[q.key] = q
	}
	require.Len(t, byKey[1].sigs, 1)
	require.True(t, verifies(oldV, byKey[1]))
	require.False(t, verifies(nextV, byKey[1]), "before the rotation: the old secret only")
	require.Len(t, byKey[2].sigs, 2, "during the window: two v1 signatures")
	require.True(t, verifies(oldV, byKey[2]), "a receiver still on the old secret")
	require.True(t, verifies(nextV, byKey[2]), "a receiver already on the new one")
	require.Len(t, byKey[3].sigs, 1)
	require.False(t, verifies(oldV, byKey[3]), "after the window: the new secret only")
	require.True(t, verifies(nextV, byKey[3]))
}

func mustRead(t *testing.T, file string) string {
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	return string(b)
}

// A secret file that is not what it should be is an error that does not
// quote it; a raw secret is the old form, one key.
func TestParseSecrets(t *testing.T) {
	a, b := NewSecret(), NewSecret()
	for _, bad := range []string{"", "\n", "whsec_!!!not-base64", "whsec_", a + "\n" + b, a + "\n" + b + " until=tomorrow",
		a + " until=2026-12-06T00:00:00Z", a + "\nsomething until=2026-12-06T00:00:00Z"} {
		_, err := ParseSecrets([]byte(bad))
		require.Error(t, err, "%q", bad)
		require.NotContains(t, err.Error(), strings.TrimPrefix(a, SecretPrefix), "no secret in the error")
		require.NotContains(t, err.Error(), strings.TrimPrefix(b, SecretPrefix), "no secret in the error")
	}
	s, err := ParseSecrets([]byte("an old raw secret\r\n"))
	require.NoError(t, err)
	require.Equal(t, Secrets{{Key: []byte("an old raw secret"), Raw: true, wh: s[0].wh}}, s)
	until := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	s, err = ParseSecrets([]byte(a + "\r\n" + b + " until=2026-12-06T12:00:00Z\n"))
	require.NoError(t, err)
	require.Len(t, s, 2)
	require.Equal(t, a, FormatSecret(s[0].Key))
	require.Equal(t, b, FormatSecret(s[1].Key))
	require.True(t, until.Equal(s[1].Until))
	require.Len(t, s.Signing(until.Add(-time.Second)), 2)
	require.Len(t, s.Signing(until), 1)
}

// A raw secret rotated out is written in the whsec_ form (the same key).
func TestRotateRawSecret(t *testing.T) {
	file := writeSecret(t, "raw-key")
	now := time.Now()
	until, err := RotateSecretFile(file, "", 2*time.Hour, now)
	require.NoError(t, err)
	s, err := ReadSecrets(file)
	require.NoError(t, err)
	require.Len(t, s, 2)
	require.False(t, s[0].Raw)
	require.Len(t, s[0].Key, 32)
	require.Equal(t, "raw-key", string(s[1].Key))
	require.True(t, until.Equal(s[1].Until))
	// A second rotation keeps the earlier key while its window runs.
	_, err = RotateSecretFile(file, "", time.Hour, now)
	require.NoError(t, err)
	s2, err := ReadSecrets(file)
	require.NoError(t, err)
	require.Len(t, s2, 3)
	require.Equal(t, s[0].Key, s2[1].Key)
	require.Equal(t, "raw-key", string(s2[2].Key))
	_, err = RotateSecretFile(file, "not a whsec secret", time.Hour, now)
	require.Error(t, err)
}

// A webhook URL's credentials never reach output.
func TestRedactTarget(t *testing.T) {
	for in, want := range map[string]string{
		"https://hooks.example/purge":                        "https://hooks.example/purge",
		"https://hooks.example/purge?api_key=SEKRIT&x=1":     "https://hooks.example/purge?api_key=xxxxx&x=xxxxx",
		"https://hooks.example/purge?SEKRIT":                 "https://hooks.example/purge?xxxxx",
		"https://u:SEKRIT@hooks.example/p#SEKRIT":            "https://xxxxx@hooks.example/p#xxxxx",
		"http://hooks.example:8080/p?token=SEKRIT&token=two": "http://hooks.example:8080/p?token=xxxxx&token=xxxxx",
	} {
		require.Equal(t, want, RedactTarget(KindWebhook, in), in)
	}
	require.Equal(t, "purges.orders", RedactTarget(KindNATS, "purges.orders"))
}
