package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// `erase --purge-stream` with credentials that may not delete messages
// (the projector's) is refused with exit 3 and one line of ours: the NATS
// client's own report of the permissions violation (its default handler
// writes it to stderr) must not appear beside it.
func TestErasePurgeRefusedPrintsOneLine(t *testing.T) {
	t.Parallel()
	bin := build(t)
	url := testenv.NewDatabase(t)
	authDir := filepath.Join(t.TempDir(), "nats")
	n := testenv.NewNATSWith(t, broker.Config{Auth: &broker.Auth{Dir: authDir, Source: "main"}})
	nc, err := nats.Connect(n.URL, natsconn.UserCredentials(broker.CaptureCreds(authDir)))
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	createMainStream(t, js, 2)

	env := append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_SOURCE_URL=", "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_METRICS_ADDR=", "EPITAPH_NATS_CREDS="+broker.ProjectorCreds(authDir))
	code, out, errOut := statusRun(t, bin, env, "erase", "--table", "public.orders", "--key", `{"id":1}`,
		"--purge-stream", "--reason", "test", "--yes")
	t.Logf("stdout: %s\nstderr: %s", out, errOut)
	require.Equal(t, 3, code)
	require.Contains(t, errOut, "nothing was erased")
	lines := strings.Split(strings.TrimSpace(errOut), "\n")
	require.Len(t, lines, 1, "one line: %s", errOut)
	require.True(t, strings.HasPrefix(lines[0], "projector: "), errOut)
}
