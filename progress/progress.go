// Package progress keeps, per (projection, version, partition), the cursor
// of a projector (the JetStream stream sequence of the last applied message)
// and the lease that says which worker may move it.
//
// The cursor only moves by compare-and-swap (Advance) inside the caller's
// transaction, the same one that writes the read model: either both commit
// or neither does. A worker holds a partition through a Lease with a fencing
// epoch that grows on every takeover; Advance checks the epoch, so a worker
// that lost its lease (paused, partitioned, slow) can never move the cursor
// again: it gets ErrLostOwnership and must stop.
//
// Lease times are Postgres times (now()), one clock shared by every worker.
package progress

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
)

// ErrLostOwnership is returned when a compare-and-swap or a lease renewal
// finds that another worker took the partition (or the cursor moved under
// the caller). The caller must stop working on the partition.
var ErrLostOwnership = errors.New("lost ownership of partition")

// Key names one work unit: partition Partition of version Version of a
// projection.
type Key struct {
	Projection string
	Version    int
	Partition  int
}

// ConsumerName names the unit, <projection>-v<N>-p<p>: in logs, and as the
// JetStream durable consumer of projectors before consumer groups (see
// GroupConsumerName).
func (k Key) ConsumerName() string {
	return k.Projection + "-v" + strconv.Itoa(k.Version) + "-p" + strconv.Itoa(k.Partition)
}

// GroupConsumerName names the unit in a consumer group (one per target):
// <group>_<projection>-v<N>-p<p>, never reused by another version or
// another group; an empty group gives ConsumerName. A worker's durable
// consumer is this name with a random part appended
// (version.NewUnitConsumer), recorded on the progress row; this name alone
// was the consumer of releases before that.
func (k Key) GroupConsumerName(group string) string {
	if group == "" {
		return k.ConsumerName()
	}
	return group + "_" + k.ConsumerName()
}

func (k Key) String() string { return k.ConsumerName() }

// Position is where a partition stands: the cursor and the identity of the
// message at the cursor, used to notice a stream that lost its tail.
type Position struct {
	// Cursor is the stream sequence of the last applied message (0: none).
	Cursor uint64
	// CommitLSN is the source position of the last applied message: the
	// commit LSN of a row or commit event, the LSN of a mark or heartbeat.
	CommitLSN event.LSN
	// Seq is the row's seq within its transaction; -1 for other messages.
	Seq int
	// MsgID is the message's Nats-Msg-Id (or a digest of its body when it
	// has none): what must still be found at Cursor in the stream.
	MsgID string
	// SourceLSN is the watermark: the partition reflects the source up to
	// this LSN. It never moves backwards.
	SourceLSN event.LSN
	// SourceTime is the source time of the watermark (commit time, or the
	// mark's time); zero when unknown. It never moves backwards.
	SourceTime time.Time

	// Trust is what the partition has verified (projection/trust.go),
	// moved with the cursor.
	Trust Trust
}

// Trust is a partition's verification state at its cursor.
type Trust struct {
	// PartSeq is the Epitaph-Partition-Seq of the last verified message
	// applied; 0 when not known (a new partition, after a rewind).
	PartSeq uint64
	// TxStart is the stream sequence after which the row messages not yet
	// verified begin (the last verified boundary, or the cursor when none
	// is pending); TxFirst is the first of them, Pending how many.
	TxStart, TxFirst uint64
	Pending          int
	// Digest is the event.Digest state over the pending row messages in
	// stream order (nil when none).
	Digest []byte
}

// Row is a progress row as stored.
type Row struct {
	Key
	Position
	Attempts            int
	LastAdvanceAt       *time.Time
	LastFailureCategory string
	LastFailureAt       *time.Time
	Owner               string
	Epoch               int64
	LeaseExpiresAt      *time.Time
	// Consumer is the JetStream consumer of the unit (RecordConsumer),
	// recorded before a worker makes it; "" when none was recorded (no
	// worker yet, or one from before consumer groups used ConsumerName).
	Consumer string
	// StreamCreated is the creation time of the stream the cursor counts
	// in (migration 0012); nil when not recorded yet.
	StreamCreated *time.Time
}

// Lease is a worker's hold on a unit. Epoch fences it: a takeover increments
// the epoch and invalidates every older lease on the unit.
type Lease struct {
	Key
	Owner     string
	Epoch     int64
	ExpiresAt time.Time
}

// DB is what this package needs of a pool, a connection or a transaction.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Ensure creates the progress rows of partitions 0..partitions-1 of a
// version if they are missing. Idempotent.
func Ensure(ctx context.Context, db DB, projection string, version, partitions int) error {
	_, err := db.Exec(ctx, `
		INSERT INTO epitaph.progress (projection, version, partition)
		SELECT $1, $2, p FROM generate_series(0, $3 - 1) AS p
		ON CONFLICT DO NOTHING`, projection, version, partitions)
	if err != nil {
		return fmt.Errorf("ensure progress rows of %s v%d: %w", projection, version, err)
	}
	return nil
}

const rowColumns = `projection, version, partition, cursor, last_commit_lsn::text, last_seq, last_msg_id,
	source_lsn::text, attempts, last_advance_at, last_failure_category, last_failure_at, owner, epoch, lease_expires_at,
	part_seq, tx_start, tx_first, tx_pending, tx_digest, consumer, stream_created`

func scanRow(r pgx.Row) (Row, error) {
	var (
		row                       Row
		cursor                    int64
		lastLSN, srcLSN           *string
		lastSeq                   *int32
		msgID, failCat, owner     *string
		consumer                  *string
		version, partition, tries int32
		partSeq, txStart, txFirst *int64
		pending                   int32
	)
	err := r.Scan(&row.Projection, &version, &partition, &cursor, &lastLSN, &lastSeq, &msgID,
		&srcLSN, &tries, &row.LastAdvanceAt, &failCat, &row.LastFailureAt, &owner, &row.Epoch, &row.LeaseExpiresAt,
		&partSeq, &txStart, &txFirst, &pending, &row.Trust.Digest, &consumer, &row.StreamCreated)
	if err != nil {
		return Row{}, err
	}
	row.Trust.PartSeq, row.Trust.TxStart, row.Trust.TxFirst = derefU(partSeq), derefU(txStart), derefU(txFirst)
	row.Trust.Pending = int(pending)
	row.Version, row.Partition, row.Attempts = int(version), int(partition), int(tries)
	row.Cursor = uint64(cursor)
	row.Seq = -1
	if lastSeq != nil {
		row.Seq = int(*lastSeq)
	}
	if lastLSN != nil {
		if row.CommitLSN, err = event.ParseLSN(*lastLSN); err != nil {
			return Row{}, err
		}
	}
	if srcLSN != nil {
		if row.SourceLSN, err = event.ParseLSN(*srcLSN); err != nil {
			return Row{}, err
		}
	}
	row.MsgID = deref(msgID)
	row.LastFailureCategory = deref(failCat)
	row.Owner = deref(owner)
	row.Consumer = deref(consumer)
	return row, nil
}

func derefU(v *int64) uint64 {
	if v == nil || *v < 0 {
		return 0
	}
	return uint64(*v)
}

func nullU(v uint64) any {
	if v == 0 {
		return nil
	}
	return int64(v)
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// Get reads one unit's progress row; pgx.ErrNoRows if it does not exist.
func Get(ctx context.Context, db DB, k Key) (Row, error) {
	row, err := scanRow(db.QueryRow(ctx, `SELECT `+rowColumns+` FROM epitaph.progress
		WHERE projection = $1 AND version = $2 AND partition = $3`, k.Projection, k.Version, k.Partition))
	if err != nil {
		return Row{}, fmt.Errorf("read progress of %s: %w", k, err)
	}
	return row, nil
}

// List reads every partition's progress row of a version, by partition.
func List(ctx context.Context, db DB, projection string, version int) ([]Row, error) {
	rows, err := db.Query(ctx, `SELECT `+rowColumns+` FROM epitaph.progress
		WHERE projection = $1 AND version = $2 ORDER BY partition`, projection, version)
	if err != nil {
		return nil, fmt.Errorf("list progress of %s v%d: %w", projection, version, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Row, error) { return scanRow(r) })
	if err != nil {
		return nil, fmt.Errorf("list progress of %s v%d: %w", projection, version, err)
	}
	return out, nil
}

func nullLSN(l event.LSN) any {
	if l == 0 {
		return nil
	}
	return l.String()
}

func nullTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

func nullSeq(s int) any {
	if s < 0 {
		return nil
	}
	return s
}

// Advance moves the cursor of l's unit from old to next.Cursor in tx, by
// compare-and-swap on (cursor, epoch): it succeeds only if the cursor is
// still old and the lease's epoch is still current, and returns
// ErrLostOwnership otherwise (nothing is changed; the caller must roll back
// and stop). The same call rewinds (next.Cursor < old). It also records the
// identity of the message at the new cursor, raises the source watermark
// (never lowers it), clears the failure count and extends the lease by ttl
// (0 leaves the expiry alone). The partition's verification state
// (next.Trust) is stored as given.
func Advance(ctx context.Context, tx pgx.Tx, l Lease, old uint64, next Position, ttl time.Duration) error {
	tag, err := tx.Exec(ctx, `
		UPDATE epitaph.progress
		SET cursor = $5, last_commit_lsn = $6::pg_lsn, last_seq = $7, last_msg_id = $8,
		    source_lsn = GREATEST(source_lsn, $9::pg_lsn), source_time = GREATEST(source_time, $13::timestamptz),
		    attempts = 0, last_advance_at = now(),
		    part_seq = $14, tx_start = $15, tx_first = $16, tx_pending = $17, tx_digest = $18,
		    lease_expires_at = CASE WHEN $11::bigint > 0 AND owner = $12
		                            THEN now() + $11::bigint * interval '1 microsecond'
		                            ELSE lease_expires_at END
		WHERE projection = $1 AND version = $2 AND partition = $3 AND cursor = $4 AND epoch = $10`,
		l.Projection, l.Version, l.Partition, int64(old), int64(next.Cursor),
		nullLSN(next.CommitLSN), nullSeq(next.Seq), next.MsgID, nullLSN(next.SourceLSN), l.Epoch,
		ttl.Microseconds(), l.Owner, nullTime(next.SourceTime),
		nullU(next.Trust.PartSeq), nullU(next.Trust.TxStart), nullU(next.Trust.TxFirst), next.Trust.Pending, next.Trust.Digest)
	if err != nil {
		return fmt.Errorf("advance cursor of %s to %d: %w", l.Key, next.Cursor, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("advance cursor of %s from %d (epoch %d): %w", l.Key, old, l.Epoch, ErrLostOwnership)
	}
	return nil
}

// RecordConsumer records on l's unit the JetStream consumer it is read
// through, fenced by the lease epoch like Advance. A worker records it
// before creating the consumer, so that whoever deletes consumers (retire)
// finds every one that may exist.
func RecordConsumer(ctx context.Context, db DB, l Lease, consumer string) error {
	tag, err := db.Exec(ctx, `
		UPDATE epitaph.progress SET consumer = $5
		WHERE projection = $1 AND version = $2 AND partition = $3 AND epoch = $4`,
		l.Projection, l.Version, l.Partition, l.Epoch, consumer)
	if err != nil {
		return fmt.Errorf("record consumer of %s: %w", l.Key, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("record consumer of %s: %w", l.Key, ErrLostOwnership)
	}
	return nil
}

// RecordFailure counts a failed attempt on the unit and its category
// (never the payload). It is fenced by the lease epoch like Advance.
func RecordFailure(ctx context.Context, db DB, l Lease, category string) error {
	tag, err := db.Exec(ctx, `
		UPDATE epitaph.progress
		SET attempts = attempts + 1, last_failure_category = $5, last_failure_at = now()
		WHERE projection = $1 AND version = $2 AND partition = $3 AND epoch = $4`,
		l.Projection, l.Version, l.Partition, l.Epoch, category)
	if err != nil {
		return fmt.Errorf("record failure of %s: %w", l.Key, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("record failure of %s: %w", l.Key, ErrLostOwnership)
	}
	return nil
}

// ClearFailures resets l's count of consecutive failures once the partition
// works again without advancing (an idle partition whose broker or target
// was briefly unreachable): it no longer counts as failing. The last
// failure's category and time stay, as history. Fenced by the epoch.
func ClearFailures(ctx context.Context, db DB, l Lease) error {
	_, err := db.Exec(ctx, `
		UPDATE epitaph.progress SET attempts = 0
		WHERE projection = $1 AND version = $2 AND partition = $3 AND epoch = $4 AND attempts > 0`,
		l.Projection, l.Version, l.Partition, l.Epoch)
	if err != nil {
		return fmt.Errorf("clear failures of %s: %w", l.Key, err)
	}
	return nil
}
