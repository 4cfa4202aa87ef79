package trust

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// CategoryUnauthenticated is the quarantine category of messages that fail
// verification.
const CategoryUnauthenticated = string(quarantine.CategoryUnauthenticated)

// MetaSigningKey is the stream metadata key where a projector meeting its
// first key may also find the public key (event.PublicKeyString), besides
// the message's event.HeaderPublicKey. Either is only believed for a
// message whose signature it verifies, and only while no key is trusted
// yet (trust on first use).
const MetaSigningKey = event.MetaSigningKey

// TrustedKey is one row of epitaph.trusted_keys.
type TrustedKey struct {
	KeyID       string
	PublicKey   ed25519.PublicKey
	FirstSeenAt time.Time
	TrustedAt   time.Time
	TrustedBy   string
	Note        string
}

// TrustedKeys lists the keys the target trusts, oldest first.
func TrustedKeys(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}) ([]TrustedKey, error) {
	rows, err := db.Query(ctx, `SELECT key_id, public_key, first_seen_at, trusted_at, trusted_by, COALESCE(note, '')
		FROM epitaph.trusted_keys ORDER BY trusted_at, key_id`)
	if err != nil {
		return nil, fmt.Errorf("list trusted keys: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (TrustedKey, error) {
		var k TrustedKey
		var pub []byte
		err := r.Scan(&k.KeyID, &pub, &k.FirstSeenAt, &k.TrustedAt, &k.TrustedBy, &k.Note)
		k.PublicKey = ed25519.PublicKey(pub)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("list trusted keys: %w", err)
	}
	return out, nil
}

// TrustKey adds pub to the target's trusted keys (idempotent: a key
// already trusted keeps its record). It returns false when it was trusted
// already. Keys are only ever added: messages signed by an older key stay
// verifiable after a rotation.
func TrustKey(ctx context.Context, db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}, pub ed25519.PublicKey, by, note string) (bool, error) {
	if len(pub) != ed25519.PublicKeySize {
		return false, fmt.Errorf("trust key: a public key of %d bytes, not %d", len(pub), ed25519.PublicKeySize)
	}
	tag, err := db.Exec(ctx, `INSERT INTO epitaph.trusted_keys (key_id, public_key, trusted_by, note)
		VALUES ($1, $2, $3, NULLIF($4, '')) ON CONFLICT (key_id) DO NOTHING`, event.KeyID(pub), []byte(pub), by, note)
	if err != nil {
		return false, fmt.Errorf("trust key %s: %w", event.KeyID(pub), err)
	}
	return tag.RowsAffected() == 1, nil
}

// LegacyBoundary is the recorded legacy boundary of one partition.
type LegacyBoundary struct {
	Stream      string
	Partition   int
	BoundarySeq uint64
	RecordedAt  time.Time
}

// LegacyBoundaries lists the recorded legacy boundaries.
func LegacyBoundaries(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}) ([]LegacyBoundary, error) {
	rows, err := db.Query(ctx, `SELECT stream, partition, boundary_seq, recorded_at FROM epitaph.legacy_boundaries ORDER BY stream, partition`)
	if err != nil {
		return nil, fmt.Errorf("list legacy boundaries: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (LegacyBoundary, error) {
		var b LegacyBoundary
		var seq int64
		err := r.Scan(&b.Stream, &b.Partition, &seq, &b.RecordedAt)
		b.BoundarySeq = uint64(seq)
		return b, err
	})
	if err != nil {
		return nil, fmt.Errorf("list legacy boundaries: %w", err)
	}
	return out, nil
}

// RecordLegacyBoundary records partition's legacy boundary in stream: the
// partition's unsigned messages at stream sequence seq or before are
// believed as written before signing (replacing a boundary recorded
// before). Only an operator records one (projector trust-key
// --legacy-boundary); a projector never infers it. Workers read it when a
// partition starts.
func RecordLegacyBoundary(ctx context.Context, db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}, stream string, partition int, seq uint64) error {
	if partition < 0 || seq > math.MaxInt64 {
		return fmt.Errorf("record legacy boundary: partition %d, sequence %d out of range", partition, seq)
	}
	if _, err := db.Exec(ctx, `INSERT INTO epitaph.legacy_boundaries (stream, partition, boundary_seq) VALUES ($1, $2, $3)
		ON CONFLICT (stream, partition) DO UPDATE SET boundary_seq = EXCLUDED.boundary_seq, recorded_at = now()`,
		stream, partition, int64(seq)); err != nil {
		return fmt.Errorf("record legacy boundary of %s partition %d: %w", stream, partition, err)
	}
	return nil
}
