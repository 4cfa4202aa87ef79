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

// NATS credentials go with an external server only; contradictory ones
// are refused in one line.
func TestNATSAuthFlagsAreChecked(t *testing.T) {
	t.Setenv("EPITAPH_SOURCE_URL", "postgres://u:secret@127.0.0.1:1/db")
	t.Setenv("EPITAPH_NATS_URL", "")
	err := run([]string{"--metrics-addr", "", "--nats-creds", "/x/projector.creds"})
	require.ErrorContains(t, err, "are for an external JetStream server (EPITAPH_NATS_URL): the embedded one makes its own credentials under <data-dir>/nats")

	t.Setenv("EPITAPH_NATS_URL", "nats://127.0.0.1:1")
	t.Setenv("EPITAPH_NATS_USER", "capture")
	err = run([]string{"--metrics-addr", ""})
	require.ErrorContains(t, err, "--nats-user needs --nats-password-file (EPITAPH_NATS_PASSWORD_FILE)")
	err = run([]string{"--metrics-addr", "", "--nats-password-file", "/x/pw", "--nats-creds", "/x/c.creds"})
	require.ErrorContains(t, err, "NATS credentials given twice (--nats-creds, --nats-user)")
	require.NotContains(t, err.Error(), "\n")
	require.NotContains(t, err.Error(), "secret")
}
