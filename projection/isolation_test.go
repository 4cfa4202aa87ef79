package projection_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/progress"
)

// Target A's projector runs with its own credentials (capture creds
// --target a) on the embedded broker. Holders of target B's credentials and
// of the capture's, each connected with its own inbox prefix (their
// JetStream requests are answered), cannot read any other client's inboxes,
// acknowledgements or advisories, cannot list A's consumers, and find none
// under the names consumers had before they carried a random part: looking
// them up or deleting them finds nothing. A's archive stays exact row by
// row, A's consumers are never deleted or made anew, and neither A's
// metrics nor its status show their names' random part.
func TestTargetCredentialsCannotReachAnotherTargetsConsumers(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	e := newEnvAuth(t, dir, 2)
	for _, target := range []string{"a", "b"} {
		require.NoError(t, broker.WriteTargetCreds(dir, src, target, broker.TargetCreds(dir, target)))
	}
	cfg := e.config("a")
	cfg.NATSAuth = natsconn.Auth{CredsFile: broker.TargetCreds(dir, "a")}
	cfg.LeaseTTL = 30 * time.Second // not a lease test: a restarted partition may reset its consumer
	a := e.start(cfg)
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 2 })
	c := e.conn()
	var txs []*txn
	publish := func(n int) {
		for i := 0; i < n; i++ {
			tx := e.nextTx(orderRows(len(txs)+1, 2)...)
			txs = append(txs, tx)
			e.publish(tx)
		}
		e.heartbeat()
	}
	publish(20)
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == len(expectedArchive(t, txs)) })

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	stream := event.StreamName(src)
	group := a.Group()
	created := map[string]time.Time{}
	_, ajs := e.nats.Connect(t) // the capture's: only to read the victims' state
	for p := 0; p < 2; p++ {
		name := recordedConsumer(t, e.url, group, 1, p)
		info, err := ajs.Consumer(ctx, stream, name)
		require.NoError(t, err)
		created[name] = info.CachedInfo().Created
	}

	for _, who := range []struct{ role, creds string }{
		{"target b", broker.TargetCreds(dir, "b")},
		{"capture", broker.CaptureCreds(dir)},
	} {
		att := testenv.NewAttacker(t, e.nats.URL, natsconn.UserCredentials(who.creds))
		// Its own inbox works: a refusal below is of the attempt itself.
		_, err := att.JS.AccountInfo(ctx)
		require.NoError(t, err, who.role)
		att.RequireRefused(t, ctx, append(att.SnoopAttempts(src, broker.TargetUser("a")), att.ListConsumers(src)))
		for p := 0; p < 2; p++ {
			k := progress.Key{Projection: "archive", Version: 1, Partition: p}
			for _, guess := range []string{k.GroupConsumerName(group), k.ConsumerName()} {
				_, err := att.JS.Consumer(ctx, stream, guess)
				require.ErrorIs(t, err, jetstream.ErrConsumerNotFound, "%s finds %s", who.role, guess)
				err = att.JS.DeleteConsumer(ctx, stream, guess)
				require.ErrorIs(t, err, jetstream.ErrConsumerNotFound, "%s deletes %s", who.role, guess)
			}
		}
	}

	publish(20)
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == len(expectedArchive(t, txs)) })
	require.Equal(t, expectedArchive(t, txs), archiveOf(t, c))
	// A's consumers are the same ones (same names, never made anew). A
	// partition restarted after a transient failure of its own (a timeout
	// on a loaded machine) may reset its consumer, and only that may: then
	// the resets are counted, and bounded by those failures.
	resets := metricSum(t, a, "epitaph_projector_consumer_resets_total")
	failures := metricSum(t, a, "epitaph_projector_transient_errors_total")
	require.LessOrEqual(t, resets, failures, "consumers reset with no failure of A's own to explain it")
	for p := 0; p < 2; p++ {
		name := recordedConsumer(t, e.url, group, 1, p)
		before, ok := created[name]
		require.True(t, ok, "partition %d reads through another consumer: %s", p, name)
		info, err := ajs.Consumer(ctx, stream, name)
		require.NoError(t, err)
		if resets == 0 {
			require.Equal(t, before, info.CachedInfo().Created, "%s made anew", name)
		}
	}
	if resets > 0 {
		t.Logf("%v resets after %v transient failures of A's own", resets, failures)
	}

	// Neither the metrics nor the status (what /status and the status
	// page serve) show a consumer's random part.
	st, err := a.Status(ctx)
	require.NoError(t, err)
	body, err := json.Marshal(st)
	require.NoError(t, err)
	var metrics strings.Builder
	mfs, err := a.Registry().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		metrics.WriteString(mf.String())
	}
	require.Greater(t, metrics.Len(), 1000)
	for name := range created {
		secret := name[strings.LastIndex(name, "-")+1:]
		require.NotContains(t, string(body), secret, "the status shows %s", name)
		require.NotContains(t, metrics.String(), secret, "the metrics show %s", name)
	}
}
