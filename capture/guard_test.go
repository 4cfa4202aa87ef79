package capture

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A stream that could be emptied behind the capture's back, through a real
// nats-server whose client may do anything: a stream made by an older
// capture, with roll-ups allowed (what an attacker holding the capture's
// credentials sets to purge it with one Nats-Rollup message), is brought to
// deny_purge at start, loudly; from then on the server itself refuses the
// purge, the roll-up and any update undoing it. A setting the server never
// lets anyone undo (allow_msg_ttl) is reported while streaming.
func TestStreamCannotBeEmptied(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT generate_series(1, 20)`)
	ctx := context.Background()
	name := event.StreamName("main")
	// As an older capture made it, then opened to roll-ups.
	_, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: name, Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Discard: jetstream.DiscardOld, Duplicates: 2 * time.Minute, AllowRollup: true,
		Metadata: map[string]string{MetaPartitions: "4", MetaSource: "main", MetaWireVersion: strconv.Itoa(event.Version), event.MetaLimits: "none"},
	})
	require.NoError(t, err)
	streamConfig := func() jetstream.StreamConfig {
		st, err := e.js.Stream(ctx, name)
		require.NoError(t, err)
		info, err := st.Info(ctx)
		require.NoError(t, err)
		return info.Config
	}

	svc := e.start(t, func(c *Config) { c.StreamCheckInterval = 100 * time.Millisecond; c.Tables = []string{"items"} })
	sc := streamConfig()
	require.True(t, sc.DenyPurge, "an existing stream is brought to deny_purge")
	require.False(t, sc.AllowRollup)
	require.False(t, sc.DenyDelete, "erase --purge-stream deletes single messages")
	require.Equal(t, 1.0, restoredCount(t, svc, guardAllowRollup))
	require.Equal(t, 1.0, restoredCount(t, svc, guardDenyPurge), "with roll-ups allowed, a missing deny_purge is no upgrade")

	e.exec(t, `DELETE FROM items WHERE id <= 3`)
	before := e.deletes(t, "main", 3)
	require.Len(t, before, 3)

	// Every way back to an empty stream is refused by the server.
	undo := sc
	undo.DenyPurge, undo.AllowRollup = false, true
	_, err = e.js.UpdateStream(ctx, undo)
	require.ErrorContains(t, err, "can not cancel deny purge")
	undo = sc
	undo.AllowRollup = true
	_, err = e.js.UpdateStream(ctx, undo)
	require.ErrorContains(t, err, "roll-ups require the purge permission")
	st, err := e.js.Stream(ctx, name)
	require.NoError(t, err)
	require.Error(t, st.Purge(ctx), "purge")
	require.Error(t, st.Purge(ctx, jetstream.WithPurgeSubject(event.StreamSubjects("main"))), "purge of a subject")
	rollup := nats.NewMsg(event.SubjectPrefix + ".main.0.mark")
	rollup.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupAll)
	_, err = e.js.PublishMsg(ctx, rollup)
	require.Error(t, err, "a roll-up message")
	after := e.deletes(t, "main", 3)
	require.Equal(t, before, after, "every event is still stored")

	// Message TTLs, which the server never disables again: reported, the
	// capture goes on.
	ttl := streamConfig()
	ttl.AllowMsgTTL = true
	_, err = e.js.UpdateStream(ctx, ttl)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return unsafeGauge(t, svc, guardAllowMsgTTL) == 1 }, 30*time.Second, 20*time.Millisecond)
	require.Zero(t, unsafeGauge(t, svc, guardDenyDelete))
	e.exec(t, `DELETE FROM items WHERE id = 4`)
	require.Len(t, e.deletes(t, "main", 4), 4)
	require.True(t, svc.CurrentStatus().Active)
}

// A stream the capture creates denies purges from the start, and counts no
// restore.
func TestNewStreamDeniesPurge(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL; INSERT INTO items VALUES (1)`)
	svc := e.start(t, func(c *Config) { c.Tables = []string{"items"} })
	e.exec(t, `DELETE FROM items`)
	require.Len(t, e.deletes(t, "main", 1), 1)
	st, err := e.js.Stream(context.Background(), event.StreamName("main"))
	require.NoError(t, err)
	info, err := st.Info(context.Background())
	require.NoError(t, err)
	require.True(t, info.Config.DenyPurge)
	require.False(t, info.Config.AllowRollup)
	require.False(t, info.Config.DenyDelete)
	require.Error(t, st.Purge(context.Background()))
	require.Zero(t, restoredCount(t, svc, guardDenyPurge))
	require.Zero(t, restoredCount(t, svc, guardAllowRollup))
}

// unsafeGauge reads epitaph_capture_stream_setting_unsafe{setting}.
func unsafeGauge(t *testing.T, svc *Service, setting string) float64 {
	t.Helper()
	mfs, err := svc.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "epitaph_capture_stream_setting_unsafe" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "setting" && l.GetValue() == setting {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	return -1
}

// The attack with the capture's own credentials on its embedded broker: the
// stream update allowing roll-ups (or cancelling deny_purge) is refused by
// the server, and so are a roll-up message and a purge; every event stays.
func TestCaptureCredentialsCannotEmptyTheStream(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	testenv.Exec(t, db, `CREATE TABLE t (id int PRIMARY KEY); ALTER TABLE t REPLICA IDENTITY FULL; INSERT INTO t VALUES (1), (2)`)
	dir := t.TempDir()
	svc := newService(t, Config{SourceURL: db, DataDir: dir, EmbeddedListen: "127.0.0.1:0", SlotName: dbName(t, db),
		Partitions: 2, HeartbeatInterval: -1})
	require.NoError(t, svc.Start(context.Background()))
	testenv.Exec(t, db, `DELETE FROM t`)

	nc, err := nats.Connect(svc.NATSURL(), natsconn.UserCredentials(broker.CaptureCreds(EmbeddedCredsDir(dir))))
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	var info *jetstream.StreamInfo
	require.Eventually(t, func() bool {
		st, err := js.Stream(ctx, "EPITAPH_MAIN")
		if err != nil {
			return false
		}
		info, err = st.Info(ctx)
		return err == nil && info.State.Msgs == 3 // two rows, a commit
	}, 30*time.Second, 50*time.Millisecond)
	require.True(t, info.Config.DenyPurge)

	undo := info.Config
	undo.AllowRollup, undo.DenyPurge = true, false
	_, err = js.UpdateStream(ctx, undo)
	require.ErrorContains(t, err, "can not cancel deny purge")
	undo.DenyPurge = true
	_, err = js.UpdateStream(ctx, undo)
	require.ErrorContains(t, err, "roll-ups require the purge permission")
	rollup := nats.NewMsg("epitaph.main.0.mark")
	rollup.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupAll)
	_, err = js.PublishMsg(ctx, rollup)
	require.Error(t, err, "a roll-up message")
	st, err := js.Stream(ctx, "EPITAPH_MAIN")
	require.NoError(t, err)
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	require.Error(t, st.Purge(pctx))

	info, err = st.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(3), info.State.Msgs, "every event is still stored")
	require.False(t, info.Config.AllowRollup)
}

// A stream made by a capture before deny_purge (no roll-ups either) is an
// upgrade: brought to deny_purge at start, not counted as a change behind
// the capture's back.
func TestOlderStreamGetsDenyPurge(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL; INSERT INTO items VALUES (1)`)
	ctx := context.Background()
	_, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: event.StreamName("main"), Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Discard: jetstream.DiscardOld, Duplicates: 2 * time.Minute,
		Metadata: map[string]string{MetaPartitions: "4", MetaSource: "main", MetaWireVersion: strconv.Itoa(event.Version), event.MetaLimits: "none"},
	})
	require.NoError(t, err)
	svc := e.start(t, func(c *Config) { c.Tables = []string{"items"} })
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	require.True(t, info.Config.DenyPurge)
	require.False(t, info.Config.AllowRollup)
	require.Zero(t, restoredCount(t, svc, guardDenyPurge), "an upgrade, not a change behind its back")
	e.exec(t, `DELETE FROM items`)
	require.Len(t, e.deletes(t, "main", 1), 1)
}
