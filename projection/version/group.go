package version

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

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

// secretLen is the random hex digits ending a unit's consumer name.
const secretLen = 32

// NewUnitConsumer is a new name for the durable consumer of unit k in
// group: <group>_<projection>-v<N>-p<p>-<32 random hex digits>. JetStream
// permissions cannot limit a user to consumers whose names start with its
// group, so the name is the capability: recorded only on the unit's
// progress row (in the target's database), never listed (no role may list
// consumers) and never shown without authentication, it keeps a holder of
// another target's (or the capture's) NATS credentials from finding the
// consumer to delete, re-create or acknowledge through it.
func NewUnitConsumer(k progress.Key, group string) (string, error) {
	b := make([]byte, secretLen/2)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("random consumer name: %w", err)
	}
	return k.GroupConsumerName(group) + "-" + hex.EncodeToString(b), nil
}

// IsUnitConsumer reports whether name is one NewUnitConsumer makes for k
// in group.
func IsUnitConsumer(name string, k progress.Key, group string) bool {
	secret, ok := strings.CutPrefix(name, k.GroupConsumerName(group)+"-")
	if !ok || len(secret) != secretLen {
		return false
	}
	_, err := hex.DecodeString(secret)
	return err == nil && strings.ToLower(secret) == secret
}

// UnitConsumer is the consumer a progress row's unit is read through: the
// one recorded on the row, else the group's deterministic name for it
// (of projectors before consumer names carried a random part).
func UnitConsumer(r progress.Row, group string) string {
	if r.Consumer != "" {
		return r.Consumer
	}
	return r.GroupConsumerName(group)
}
