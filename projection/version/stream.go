package version

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// PositionLSN is the source position a message stands for (its commit
// LSN; a mark's LSN; a gap's end), as the runtime's cursors record it.
func PositionLSN(e *event.Event) event.LSN {
	switch e.Op {
	case event.OpMark:
		return e.LSN
	case event.OpGap:
		return e.ToLSN
	default:
		return e.CommitLSN
	}
}

// StreamPartitions reads the partition count P of a source's stream
// from its metadata (event.MetaPartitions).
func StreamPartitions(info *jetstream.StreamInfo) (int, error) {
	s, ok := info.Config.Metadata[event.MetaPartitions]
	if !ok {
		return 0, fmt.Errorf("stream %s has no epitaph.partitions metadata", info.Config.Name)
	}
	var n int
	if _, err := fmt.Sscanf(s, "%d", &n); err != nil || n < 1 {
		return 0, fmt.Errorf("stream %s: bad epitaph.partitions %q", info.Config.Name, s)
	}
	return n, nil
}

// CheckedPartitions is StreamPartitions checked against the stream itself.
// The metadata is not signed, and whoever may update the stream (the
// capture's credential) may rewrite it: a count below the real one would
// have a new version consume only the first partitions and be ready while
// the others are never read. Partitions are numbered from 0 and the
// capture publishes to each (heartbeats at least), so a message on a
// subject of partition n (the count) shows the count is wrong; it is
// refused loudly.
func CheckedPartitions(ctx context.Context, stream jetstream.Stream, source string) (int, error) {
	info := stream.CachedInfo()
	n, err := StreamPartitions(info)
	if err != nil {
		return 0, err
	}
	raw, err := stream.GetMsg(ctx, 1, jetstream.WithGetMsgSubject(event.PartitionFilter(source, n)))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return n, nil
	case err != nil:
		return 0, fmt.Errorf("stream %s: check its partition count: %w", info.Config.Name, err)
	}
	return 0, fmt.Errorf("stream %s: its epitaph.partitions metadata says %d partitions, but it holds messages of partition %d (%s at sequence %d): "+
		"the metadata was changed; restore it to the capture's --partitions", info.Config.Name, n, n, raw.Subject, raw.Sequence)
}
