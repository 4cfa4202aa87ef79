package version

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// RebuildOptions say how a new version is built.
type RebuildOptions struct {
	// Projection to rebuild; only archive.Projection exists.
	Projection string
	// Source names the stream (EPITAPH_<SOURCE>); default "main".
	Source string
	// FromTime, when set, makes a partial rebuild: every partition starts at
	// its first message stored in the stream at or after FromTime (found
	// with a DeliverByStartTime probe consumer), so the version holds only
	// what was deleted since. Zero = from the start of the stream.
	FromTime time.Time
	// Note is recorded in the version's config (who asked and why).
	Note string
	// Period partitions the new version's rows by commit_time
	// (archive.PeriodDay, PeriodWeek, PeriodMonth; "" the default).
	Period string
}

// CreateVersion creates the next version of a projection for a rebuild:
// version N+1 (N the highest version ever created, so a number, a schema
// archive_v<N+1> and the consumers <projection>-v<N+1>-p<p> are never
// reused), in state building, with an empty schema created by the
// projection's own DDL, its progress rows at the start (or at FromTime),
// and the boundary: the stream's last sequence now and the source LSN of
// the message there. Running workers discover it on their next balance and
// build it beside the live version. Everything is one transaction: on
// error nothing is created.
func CreateVersion(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, opts RebuildOptions) (Version, error) {
	if opts.Projection == "" {
		opts.Projection = archive.Projection
	}
	if opts.Projection != archive.Projection {
		return Version{}, fmt.Errorf("rebuild %q: unknown projection (only %q exists)", opts.Projection, archive.Projection)
	}
	if opts.Source == "" {
		opts.Source = "main"
	}
	p, err := planRebuild(ctx, js, opts)
	if err != nil {
		return Version{}, err
	}
	var v Version
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		v, err = p.create(ctx, tx, opts.Projection)
		return err
	})
	if err != nil {
		return Version{}, err
	}
	return GetVersion(ctx, pool, v.Projection, v.Version)
}

// rebuildPlan is what the stream says a new version starts from, read
// before the version's transaction.
type rebuildPlan struct {
	partitions int
	// boundary is the stream's last sequence, boundaryLSN (nil or text)
	// the source position of the message there.
	boundary    uint64
	boundaryLSN any
	// head is the stream's removed beginning (nil: none, or partial).
	head *removedGap
	// starts are the partitions' first cursors of a partial rebuild.
	starts   []uint64
	fromTime *time.Time
	config   []byte
	period   string
}

// removedGap is the removed_from_stream gap of a stream's removed head.
type removedGap struct {
	toSeq uint64
	toLSN event.LSN
}

// planRebuild reads the stream: its partitions, the boundary, what it has
// lost of its beginning, and the partial rebuild's starts.
func planRebuild(ctx context.Context, js jetstream.JetStream, opts RebuildOptions) (*rebuildPlan, error) {
	stream, err := js.Stream(ctx, event.StreamName(opts.Source))
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", event.StreamName(opts.Source), err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream info: %w", err)
	}
	p := &rebuildPlan{boundary: info.State.LastSeq}
	if p.partitions, err = CheckedPartitions(ctx, stream, opts.Source); err != nil {
		return nil, err
	}
	if p.boundaryLSN, err = boundaryLSN(ctx, stream, p.boundary); err != nil {
		return nil, err
	}
	if p.head, err = removedHead(ctx, stream, info, opts.FromTime); err != nil {
		return nil, err
	}
	if p.head != nil {
		// A head removed by erasures alone (every message in the
		// erasure ledger) is no gap.
		erased, err := headErased(ctx, js, opts.Source, p.head.toSeq)
		if err != nil {
			return nil, fmt.Errorf("read the erasure ledger: %w", err)
		}
		if erased {
			p.head = nil
		}
	}
	from := "start"
	if !opts.FromTime.IsZero() {
		if p.starts, err = startsAt(ctx, stream, opts.Source, p.partitions, opts.FromTime, p.boundary); err != nil {
			return nil, err
		}
		from, p.fromTime = "time", &opts.FromTime
	}
	period, err := archive.ParsePeriod(opts.Period)
	if err != nil {
		return nil, err
	}
	p.period = period
	if p.config, err = json.Marshal(map[string]any{"created": "rebuild", "note": opts.Note, "from": from, "archive_partition": period}); err != nil {
		return nil, fmt.Errorf("encode version config: %w", err)
	}
	return p, nil
}

// boundaryLSN is the source position (as text) of the message at the
// boundary; nil when there is none or it is not an Epitaph message.
func boundaryLSN(ctx context.Context, stream jetstream.Stream, boundary uint64) (any, error) {
	if boundary == 0 {
		return nil, nil
	}
	raw, err := stream.GetMsg(ctx, boundary)
	switch {
	case err == nil:
		if e, err := (&event.Decoder{}).Decode(raw.Data); err == nil && PositionLSN(e) != 0 {
			return PositionLSN(e).String(), nil
		}
	case errors.Is(err, jetstream.ErrMsgNotFound):
	default:
		return nil, fmt.Errorf("read the boundary message %d: %w", boundary, err)
	}
	return nil, nil
}

// create makes the version in tx: its row, tables, progress rows, the gap
// of the removed head and the starts of a partial rebuild.
func (p *rebuildPlan) create(ctx context.Context, tx pgx.Tx, name string) (Version, error) {
	if err := LockVersions(ctx, tx); err != nil {
		return Version{}, err
	}
	var n int
	if err := tx.QueryRow(ctx, `SELECT COALESCE(max(version), 0) + 1 FROM epitaph.projection_versions WHERE projection = $1`,
		name).Scan(&n); err != nil {
		return Version{}, fmt.Errorf("next version: %w", err)
	}
	if n == 1 {
		return Version{}, errors.New("no live version yet: start a projector worker first (it creates version 1)")
	}
	v := Version{Projection: name, Version: n, State: StateBuilding, Schema: archive.Schema(n),
		Partitions: p.partitions, Period: p.period}
	_, err := tx.Exec(ctx, `
		INSERT INTO epitaph.projection_versions
		    (projection, version, state, schema_name, partitions, boundary_seq, boundary_lsn, building_at, from_time, config)
		VALUES ($1, $2, 'building', $3, $4, $5, $6::pg_lsn, now(), $7, $8)`,
		v.Projection, v.Version, v.Schema, p.partitions, int64(p.boundary), p.boundaryLSN, p.fromTime, string(p.config))
	if err != nil {
		return Version{}, fmt.Errorf("create %s v%d: %w", v.Projection, v.Version, err)
	}
	if err := CreateVersionTables(ctx, tx, v, snapshot.DDL); err != nil {
		return Version{}, err
	}
	if err := progress.Ensure(ctx, tx, v.Projection, v.Version, p.partitions); err != nil {
		return Version{}, err
	}
	return v, p.position(ctx, tx, v)
}

// position records the removed head as a gap and sets the cursors of a
// partial rebuild.
func (p *rebuildPlan) position(ctx context.Context, tx pgx.Tx, v Version) error {
	if p.head != nil {
		var toLSN any
		if p.head.toLSN != 0 {
			toLSN = p.head.toLSN.String()
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+ident(v.Schema, "gaps")+` (kind, to_lsn, from_seq, to_seq)
			VALUES ('removed_from_stream', $1::pg_lsn, 1, $2)`, toLSN, int64(p.head.toSeq)); err != nil {
			return fmt.Errorf("record the removed head of the stream: %w", err)
		}
	}
	for i, start := range p.starts {
		if _, err := tx.Exec(ctx, `UPDATE epitaph.progress SET cursor = $4
			WHERE projection = $1 AND version = $2 AND partition = $3`, v.Projection, v.Version, i, int64(start)); err != nil {
			return fmt.Errorf("start partition %d at %d: %w", i, start, err)
		}
	}
	return nil
}

// startsAt finds, per partition, the cursor just before its first message
// stored at or after t (the last sequence when there is none).
func startsAt(ctx context.Context, stream jetstream.Stream, source string, partitions int, t time.Time, last uint64) ([]uint64, error) {
	out := make([]uint64, partitions)
	for p := range out {
		c, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
			FilterSubject:     event.PartitionFilter(source, p),
			DeliverPolicy:     jetstream.DeliverByStartTimePolicy,
			OptStartTime:      &t,
			AckPolicy:         jetstream.AckNonePolicy,
			InactiveThreshold: time.Minute,
		})
		if err != nil {
			return nil, fmt.Errorf("probe partition %d from %s: %w", p, t.Format(time.RFC3339), err)
		}
		name := c.CachedInfo().Name
		out[p] = last
		if c.CachedInfo().NumPending > 0 {
			first, err := firstSequence(ctx, c)
			if err != nil {
				return nil, fmt.Errorf("probe partition %d: %w", p, err)
			}
			if first > 0 {
				// Never start inside a transaction: back up to its first
				// row, so the version holds it whole (its rows stored
				// before t, its commit after) and verifies it.
				if first, err = transactionStart(ctx, stream, p, first); err != nil {
					return nil, fmt.Errorf("probe partition %d: %w", p, err)
				}
				out[p] = first - 1
			}
		}
		_ = stream.DeleteConsumer(ctx, name)
	}
	return out, nil
}

// isRowSubject reports whether a subject is a row message's
// (epitaph.<src>.<p>.delete|truncate...): one of a transaction before its
// commit.
func isRowSubject(subject string) bool {
	parts := strings.SplitN(subject, ".", 5)
	return len(parts) >= 4 && (parts[3] == "delete" || parts[3] == "truncate")
}

// transactionStart is the stream sequence of the first row message of the
// transaction that the message at seq (of partition p) belongs to: seq
// itself unless it is a row message preceded, in its partition, by more
// row messages (a transaction's messages are contiguous in its partition,
// up to its commit).
func transactionStart(ctx context.Context, stream jetstream.Stream, p int, seq uint64) (uint64, error) {
	raw, err := stream.GetMsg(ctx, seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return seq, nil
	}
	if err != nil {
		return 0, err
	}
	if !isRowSubject(raw.Subject) {
		return seq, nil
	}
	start := seq
	for s := seq - 1; s >= 1; s-- {
		raw, err := stream.GetMsg(ctx, s)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return 0, err
		}
		if q, err := event.PartitionOf(raw.Subject); err != nil || q != p {
			continue
		}
		if !isRowSubject(raw.Subject) {
			break
		}
		start = s
	}
	return start, nil
}

// firstSequence is the stream sequence of the first message c delivers,
// 0 when none is. The server ends the fetch (the message, or its expiry):
// with a deadline of the client's own (FetchContext), nats.go gives the
// server only 90% of it, and a message the server sent after the client
// gave up would be lost here, the partition started at the stream's end
// (see fetchPage in the projection package). The batch is read to its end,
// so nats.go's fetch goroutine has ended when this returns.
func firstSequence(ctx context.Context, c jetstream.Consumer) (uint64, error) {
	wait := 5 * time.Second
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
		wait = max(time.Until(dl), time.Millisecond)
	}
	msgs, err := c.Fetch(1, jetstream.FetchMaxWait(wait))
	if err != nil {
		return 0, err
	}
	var seq uint64
	var bad error
	for m := range msgs.Messages() {
		md, err := m.Metadata()
		if err != nil {
			bad = cmp.Or(bad, err)
			continue
		}
		seq = md.Sequence.Stream
	}
	if err := cmp.Or(bad, msgs.Error()); err != nil {
		return 0, err
	}
	return seq, nil // 0: none delivered (they left the stream meanwhile)
}

// Head is a stream's removed beginning: the messages up to ToSeq are gone,
// ToLSN is the source position of the first one still there (0: unknown).
type Head struct {
	ToSeq uint64
	ToLSN event.LSN
}

// StreamHead reads what source's stream has lost of its beginning (nil:
// it starts at sequence 1, or only erasures removed it: every removed
// message is in the erasure ledger, as for a rebuild).
func StreamHead(ctx context.Context, js jetstream.JetStream, source string) (*Head, error) {
	stream, err := js.Stream(ctx, event.StreamName(source))
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", event.StreamName(source), err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream info: %w", err)
	}
	g, err := removedHead(ctx, stream, info, time.Time{})
	if err != nil || g == nil {
		return nil, err
	}
	erased, err := headErased(ctx, js, source, g.toSeq)
	if err != nil {
		return nil, fmt.Errorf("read the erasure ledger: %w", err)
	}
	if erased {
		return nil, nil
	}
	return &Head{ToSeq: g.toSeq, ToLSN: g.toLSN}, nil
}

// removedHead is what a full rebuild cannot see: the stream's first
// sequences, removed (purged, aged out, discarded by a limit) before the
// version was created. A version built from such a stream lacks their
// rows, so it is created with a removed_from_stream gap for them (every
// partition, from the beginning up to the stream's first message): it is
// not ready, and cannot be promoted, until an operator acknowledges that
// the history is gone (projector gaps ack). nil when the stream holds its
// beginning, or for a partial rebuild (--from-time), which asks for less.
func removedHead(ctx context.Context, stream jetstream.Stream, info *jetstream.StreamInfo, fromTime time.Time) (*removedGap, error) {
	first := info.State.FirstSeq
	if !fromTime.IsZero() || first <= 1 {
		return nil, nil
	}
	g := &removedGap{toSeq: first - 1}
	if first <= info.State.LastSeq {
		raw, err := stream.GetMsg(ctx, first)
		switch {
		case err == nil:
			if e, err := (&event.Decoder{}).Decode(raw.Data); err == nil {
				g.toLSN = PositionLSN(e)
			}
		case errors.Is(err, jetstream.ErrMsgNotFound):
		default:
			return nil, fmt.Errorf("read the stream's first message %d: %w", first, err)
		}
	}
	return g, nil
}
