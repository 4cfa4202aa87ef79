package version

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"

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
// hex digits of sha256 of "<system_identifier>/<database name>". Two databases of one server, or one database name on two
// servers, get different groups; the same database always the same.
func DefaultGroup(ctx context.Context, db progress.DB) (string, error) {
	var id string
	if err := db.QueryRow(ctx, `SELECT system_identifier::text || '/' || current_database() FROM pg_control_system()`).Scan(&id); err != nil {
		return "", fmt.Errorf("read the target's system identifier for the consumer group: %w", err)
	}
	sum := sha256.Sum256([]byte(id))
	return hex.EncodeToString(sum[:])[:8], nil
}

// UnitConsumer is the consumer a progress row's unit is read through: the
// one recorded on the row, else the group's name for it.
func UnitConsumer(r progress.Row, group string) string {
	if r.Consumer != "" {
		return r.Consumer
	}
	return r.GroupConsumerName(group)
}
