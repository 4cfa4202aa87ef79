package version

import (
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
