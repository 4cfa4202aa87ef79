package capture

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

func TestParseRetention(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]Limits{
		"":                                    {},
		"0":                                   {},
		"720h":                                {MaxAge: 720 * time.Hour},
		"max-age=90m":                         {MaxAge: 90 * time.Minute},
		"max-bytes=50G, max-msgs=1000":        {MaxBytes: 50 << 30, MaxMsgs: 1000},
		"max-bytes=512":                       {MaxBytes: 512},
		"max-bytes=2KiB":                      {MaxBytes: 2048},
		"max-msgs-per-subject=7":              {MaxMsgsPerSubject: 7},
		"max-age=1h,max-bytes=1M":             {MaxAge: time.Hour, MaxBytes: 1 << 20},
		"max-age=24h0m0s,max-msgs=10":         {MaxAge: 24 * time.Hour, MaxMsgs: 10},
		"max-bytes=1T,max-msgs-per-subject=3": {MaxBytes: 1 << 40, MaxMsgsPerSubject: 3},
	} {
		got, err := ParseRetention(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
		back, err := ParseRetention(map[bool]string{true: "", false: got.String()}[got == Limits{}])
		require.NoError(t, err, got.String())
		require.Equal(t, got, back, "String reads back: %s", got)
	}
	require.Equal(t, "none", Limits{}.String())
	for _, bad := range []string{"forever", "max-age=-1h", "max-bytes=lots", "max-msgs=-3", "max-size=1", "max-age", "-5m"} {
		_, err := ParseRetention(bad)
		require.Error(t, err, bad)
		require.NotContains(t, err.Error(), "\n")
	}
}

func TestLimitsPlan(t *testing.T) {
	t.Parallel()
	sc := func(discard jetstream.DiscardPolicy, l Limits, record string) jetstream.StreamConfig {
		c := jetstream.StreamConfig{Name: "EPITAPH_MAIN", Discard: discard, Metadata: map[string]string{}}
		applyLimits(&c, l)
		if record == "" {
			delete(c.Metadata, event.MetaLimits)
		} else {
			c.Metadata[event.MetaLimits] = record
		}
		return c
	}
	// Nothing asked, nothing set, recorded: nothing to do.
	cs, ok := limitsPlan(sc(jetstream.DiscardOld, Limits{}, "none"), Limits{})
	require.Empty(t, cs)
	require.True(t, ok)
	// A stream of a capture before records: max-age was its own.
	cs, ok = limitsPlan(sc(jetstream.DiscardOld, Limits{MaxAge: time.Hour}, ""), Limits{MaxAge: 2 * time.Hour})
	require.False(t, ok)
	require.Equal(t, []limitChange{{name: limitMaxAge, now: "1h0m0s", want: "2h0m0s", discards: true}}, cs)
	// A max-bytes nobody asked for, with discard old: foreign and discarding.
	cs, _ = limitsPlan(sc(jetstream.DiscardOld, Limits{MaxBytes: 1 << 20}, "none"), Limits{})
	require.Equal(t, []limitChange{{name: limitMaxBytes, now: "1048576", want: "unlimited", foreign: true, discards: true}}, cs)
	// The same with discard new discards nothing (publishes fail instead):
	// left alone. Its max age still removes messages.
	cs, _ = limitsPlan(sc(jetstream.DiscardNew, Limits{MaxBytes: 1 << 20}, "none"), Limits{})
	require.Empty(t, cs)
	dn := jetstream.StreamConfig{Discard: jetstream.DiscardNew, MaxBytes: 1 << 20, MaxAge: time.Hour, Metadata: map[string]string{event.MetaLimits: "none"}}
	cs, _ = limitsPlan(dn, Limits{})
	require.Equal(t, []limitChange{{name: limitMaxAge, now: "1h0m0s", want: "unlimited", foreign: true, discards: true}}, cs)
	applyLimits(&dn, Limits{})
	require.Equal(t, int64(1<<20), dn.MaxBytes, "a discard new limit is kept")
	require.Zero(t, dn.MaxAge)
	// The operator changed --retention: the old value is the capture's own.
	cs, _ = limitsPlan(sc(jetstream.DiscardOld, Limits{MaxAge: time.Hour}, "max-age=1h0m0s"), Limits{})
	require.Equal(t, []limitChange{{name: limitMaxAge, now: "1h0m0s", want: "unlimited", discards: true}}, cs)
	// A looser limit than asked discards nothing more.
	cs, _ = limitsPlan(sc(jetstream.DiscardOld, Limits{MaxMsgs: 100}, "max-msgs=10"), Limits{MaxMsgs: 10})
	require.Equal(t, []limitChange{{name: limitMaxMsgs, now: "100", want: "10", foreign: true}}, cs)
}

// The stream's limits through a real nats-server: a discarding limit not
// asked by --retention is refused at start naming it, accepted when asked,
// restored while streaming when changed behind the capture's back (and
// counted), and an operator's own change of --retention is applied.
func TestStreamLimits(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT generate_series(1, 20)`)
	ctx := context.Background()
	name := event.StreamName("main")
	streamConfig := func() jetstream.StreamConfig {
		st, err := e.js.Stream(ctx, name)
		require.NoError(t, err)
		info, err := st.Info(ctx)
		require.NoError(t, err)
		return info.Config
	}
	edit := func(f func(*jetstream.StreamConfig)) {
		sc := streamConfig()
		f(&sc)
		_, err := e.js.UpdateStream(ctx, sc)
		require.NoError(t, err)
	}
	fast := func(c *Config) { c.StreamCheckInterval = 100 * time.Millisecond; c.Tables = []string{"items"} }

	// First start: no limits, recorded.
	svc := e.start(t, fast)
	sc := streamConfig()
	require.Equal(t, Limits{}, limitsOf(sc))
	require.Equal(t, "none", sc.Metadata[event.MetaLimits])
	require.Equal(t, jetstream.DiscardOld, sc.Discard)

	// Behind its back while streaming: max-bytes, max-age and
	// max-msgs-per-subject are each restored and counted.
	for _, c := range []struct {
		limit string
		set   func(*jetstream.StreamConfig)
	}{
		{limitMaxBytes, func(sc *jetstream.StreamConfig) { sc.MaxBytes = 1 << 20 }},
		{limitMaxAge, func(sc *jetstream.StreamConfig) { sc.MaxAge = time.Hour }},
		{limitPerSubject, func(sc *jetstream.StreamConfig) { sc.MaxMsgsPerSubject = 5 }},
	} {
		edit(c.set)
		require.Eventually(t, func() bool { return limitsOf(streamConfig()) == Limits{} }, 60*time.Second, 50*time.Millisecond, c.limit)
		require.Eventually(t, func() bool {
			return restoredCount(t, svc, c.limit) == 1
		}, 10*time.Second, 20*time.Millisecond, c.limit)
	}
	// Still streaming.
	e.exec(t, `DELETE FROM items WHERE id = 1`)
	require.Len(t, e.deletes(t, "main", 1), 1)
	require.True(t, svc.CurrentStatus().Active)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	// Changed while it was down: refused at start, naming the limit and
	// both fixes; the stream is left as it is.
	edit(func(sc *jetstream.StreamConfig) { sc.MaxBytes = 1 << 20 })
	err := e.startErr(t, fast)
	requireFix(t, err, "stream EPITAPH_MAIN has max-bytes=1048576, not asked by --retention (none)",
		"nats stream edit EPITAPH_MAIN --max-bytes=-1", "--retention max-bytes=1048576")
	require.Equal(t, int64(1<<20), streamConfig().MaxBytes)

	// Asked for: accepted, and kept (recorded) from then on.
	svc = e.start(t, func(c *Config) { fast(c); c.RetentionMaxBytes = 1 << 20 })
	require.Equal(t, "max-bytes=1048576", streamConfig().Metadata[event.MetaLimits])
	edit(func(sc *jetstream.StreamConfig) { sc.MaxBytes = 4096 })
	require.Eventually(t, func() bool { return streamConfig().MaxBytes == 1<<20 }, 60*time.Second, 50*time.Millisecond)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	// The operator's own change of --retention (the recorded value is
	// the capture's): applied without a refusal, in both directions.
	svc = e.start(t, func(c *Config) { fast(c); c.Retention = 48 * time.Hour })
	require.Equal(t, Limits{MaxAge: 48 * time.Hour}, limitsOf(streamConfig()))
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	svc = e.start(t, fast)
	require.Equal(t, Limits{}, limitsOf(streamConfig()))
	require.Zero(t, restoredCount(t, svc, limitMaxAge), "not counted as behind its back")

}

// restoredCount reads epitaph_capture_stream_limits_restored_total{limit}.
func restoredCount(t *testing.T, svc *Service, limit string) float64 {
	t.Helper()
	mfs, err := svc.reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "epitaph_capture_stream_limits_restored_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "limit" && l.GetValue() == limit {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}
