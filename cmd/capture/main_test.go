package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestMissingSourceURL(t *testing.T) {
	t.Setenv("EPITAPH_SOURCE_URL", "")
	err := run([]string{"--metrics-addr", ""})
	require.ErrorContains(t, err, "EPITAPH_SOURCE_URL")
}

func TestFlagsFromEnv(t *testing.T) {
	t.Setenv("EPITAPH_PARTITIONS", "-1")
	t.Setenv("EPITAPH_SOURCE_URL", "postgres://u:secret@127.0.0.1:1/db")
	t.Setenv("EPITAPH_NATS_URL", "nats://127.0.0.1:1")
	err := run(nil)
	require.ErrorContains(t, err, "partitions must be 1..1024, got -1")
	require.NotContains(t, err.Error(), "secret")
}

func TestStandbyNeedsExternalBroker(t *testing.T) {
	t.Setenv("EPITAPH_SOURCE_URL", "postgres://u:secret@127.0.0.1:1/db")
	t.Setenv("EPITAPH_NATS_URL", "")
	t.Setenv("EPITAPH_STANDBY", "true")
	err := run([]string{"--metrics-addr", ""})
	require.ErrorContains(t, err, "standby needs an external JetStream server (EPITAPH_NATS_URL)")
}

// A malformed setting is refused, naming it, never replaced by the default.
func TestBadEnvironmentIsRefused(t *testing.T) {
	t.Setenv("EPITAPH_SOURCE_URL", "postgres://u:secret@127.0.0.1:1/db")
	t.Setenv("EPITAPH_PARTITIONS", "eight")
	t.Setenv("EPITAPH_HEARTBEAT_INTERVAL", "10")
	t.Setenv("EPITAPH_STANDBY", "yes please")
	t.Setenv("EPITAPH_RETENTION", "max-bytes=lots")
	err := run([]string{"--metrics-addr", ""})
	require.ErrorContains(t, err, `EPITAPH_RETENTION="max-bytes=lots"`)
	require.ErrorContains(t, err, `EPITAPH_PARTITIONS="eight"`)
	require.ErrorContains(t, err, `EPITAPH_HEARTBEAT_INTERVAL="10"`)
	require.ErrorContains(t, err, `EPITAPH_STANDBY="yes please"`)

	// The command line overrides the environment.
	t.Setenv("EPITAPH_PARTITIONS", "3")
	t.Setenv("EPITAPH_HEARTBEAT_INTERVAL", "")
	t.Setenv("EPITAPH_STANDBY", "")
	t.Setenv("EPITAPH_RETENTION", "max-age=720h,max-bytes=50G")
	err = run([]string{"--metrics-addr", "", "--partitions", "-5", "--nats-url", "nats://127.0.0.1:1"})
	require.ErrorContains(t, err, "partitions must be 1..1024, got -5")
}
