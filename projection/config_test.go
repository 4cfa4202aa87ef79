package projection_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection"
)

func TestParseTTLs(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want map[string]time.Duration
		err  bool
	}{
		{"", map[string]time.Duration{}, false},
		{"public.sessions=720h,*=8760h", map[string]time.Duration{"public.sessions": 720 * time.Hour, "*": 8760 * time.Hour}, false},
		{" public.a = 30d , ", map[string]time.Duration{"public.a": 30 * 24 * time.Hour}, false},
		{"public.a", nil, true},
		{"public.a=forever", nil, true},
		{"public.a=1.5d", nil, true},
	} {
		got, err := projection.ParseTTLs(tc.in)
		if tc.err {
			require.Error(t, err, tc.in)
			continue
		}
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want, got, tc.in)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	ok := projection.Config{TargetURL: "postgres://x/y", NATSURL: "nats://127.0.0.1:4222", WorkerID: "w"}
	_, err := projection.New(ok)
	require.NoError(t, err)
	for name, mutate := range map[string]func(*projection.Config){
		"no target":       func(c *projection.Config) { c.TargetURL = "" },
		"no nats":         func(c *projection.Config) { c.NATSURL = "" },
		"no worker":       func(c *projection.Config) { c.WorkerID = "" },
		"bad source":      func(c *projection.Config) { c.SourceName = "a.b" },
		"batch too big":   func(c *projection.Config) { c.BatchSize = 501 },
		"lease too short": func(c *projection.Config) { c.LeaseTTL = time.Millisecond },
		"ttl key":         func(c *projection.Config) { c.ArchiveTTL = map[string]time.Duration{"sessions": time.Hour} },
		"ttl negative":    func(c *projection.Config) { c.ArchiveTTL = map[string]time.Duration{"*": -time.Hour} },
		"root":            func(c *projection.Config) { c.SnapshotRoots = []string{"orders"} },
		"balance >= ttl":  func(c *projection.Config) { c.LeaseTTL, c.BalanceInterval = time.Second, time.Second },
		"max row bytes":   func(c *projection.Config) { c.MaxRowBytes = -1 },
		"tcp timeout":     func(c *projection.Config) { c.TargetTCPTimeout = 500 * time.Millisecond },
		"tcp timeout big": func(c *projection.Config) { c.TargetTCPTimeout = 25 * time.Hour },
	} {
		c := ok
		mutate(&c)
		_, err := projection.New(c)
		require.Error(t, err, name)
	}
	c := ok
	c.TargetTCPTimeout = 500 * time.Millisecond
	_, err = projection.New(c)
	require.ErrorContains(t, err, "target TCP timeout 500ms: use 1s to 24h (--target-tcp-timeout 0: the system's default)")
	for _, d := range []time.Duration{-1, time.Second, 24 * time.Hour} {
		c.TargetTCPTimeout = d
		_, err = projection.New(c)
		require.NoError(t, err, "%v", d)
	}
}
