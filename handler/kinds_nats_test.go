package handler

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A nats handler whose subject the projector's credential may not publish
// to (the capture's embedded broker gives the projector role no such
// right) fails its attempt at once, naming the permission: the server
// drops such a publish and never answers it, and the attempt used to wait
// out its whole deadline (90% of the claim timeout, 4.5 min by default)
// with the delivery in flight.
func TestNATSHandlerRefusedPublishFailsSoonNamingThePermission(t *testing.T) {
	e := newTenv(t)
	dir := t.TempDir()
	n := testenv.NewNATSWith(t, broker.Config{Auth: &broker.Auth{Dir: dir, Source: "main"}})
	n.Opts = []nats.Option{nats.UserCredentials(filepath.Join(dir, broker.ProjectorCredsFile))}
	_, js := n.Connect(t)
	def := e.addHandler(KindNATS, "purges.orders")
	d := e.dispatcher(Config{JetStream: js})

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // the attempt's deadline
	defer cancel()
	start := time.Now()
	err := d.run.run(ctx, def, Delivery{ID: newUUID(), HandlerID: def.ID, Attempt: 1})
	require.Error(t, err)
	require.Less(t, time.Since(start), 15*time.Second, "failed soon, not at the attempt's deadline: %v", err)
	require.Contains(t, err.Error(), "ermission")
	require.Contains(t, err.Error(), "purges.orders")
}
