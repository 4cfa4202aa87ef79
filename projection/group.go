package projection

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// resolveGroup is group when set (validated), else the target's default.
func resolveGroup(ctx context.Context, db progress.DB, group string) (string, error) {
	if group != "" {
		return group, version.ValidateGroup(group)
	}
	return version.DefaultGroup(ctx, db)
}

// deleteConsumers deletes the named consumers of a stream, those already
// gone ignored.
func deleteConsumers(ctx context.Context, stream jetstream.Stream, names ...string) error {
	seen := map[string]bool{}
	for _, n := range names {
		if n == "" || seen[n] {
			continue
		}
		seen[n] = true
		if err := stream.DeleteConsumer(ctx, n); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return fmt.Errorf("delete consumer %s: %w", n, err)
		}
	}
	return nil
}
