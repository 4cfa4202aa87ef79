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
