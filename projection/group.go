package projection

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/progress"
)

// maxGroupLen bounds a consumer group name (JetStream consumer names are
// limited; the group is a prefix of every durable consumer).
const maxGroupLen = 32

// ValidateGroup checks a consumer group name: 1..32 letters, digits and
// '-' (the '_' separates it from the unit's name in the consumer's name).
func ValidateGroup(g string) error {
	if g == "" || len(g) > maxGroupLen {
		return fmt.Errorf("consumer group %q: want 1..%d letters, digits or '-'", g, maxGroupLen)
	}
	for _, r := range g {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
			return fmt.Errorf("consumer group %q: want 1..%d letters, digits or '-'", g, maxGroupLen)
		}
	}
	return nil
}

// DefaultGroup is the consumer group of a target database: the first 8
// hex digits of sha256 of "<system_identifier>/<database name>" (DESIGN
// section 7). Two databases of one server, or one database name on two
// servers, get different groups; the same database always the same.
func DefaultGroup(ctx context.Context, db progress.DB) (string, error) {
	var id string
	if err := db.QueryRow(ctx, `SELECT system_identifier::text || '/' || current_database() FROM pg_control_system()`).Scan(&id); err != nil {
		return "", fmt.Errorf("read the target's system identifier for the consumer group: %w", err)
	}
	sum := sha256.Sum256([]byte(id))
	return hex.EncodeToString(sum[:])[:8], nil
}

// resolveGroup is group when set (validated), else the target's default.
func resolveGroup(ctx context.Context, db progress.DB, group string) (string, error) {
	if group != "" {
		return group, ValidateGroup(group)
	}
	return DefaultGroup(ctx, db)
}

// unitConsumer is the consumer a progress row's unit is read through: the
// one recorded on the row, else the group's name for it.
func unitConsumer(r progress.Row, group string) string {
	if r.Consumer != "" {
		return r.Consumer
	}
	return r.GroupConsumerName(group)
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
