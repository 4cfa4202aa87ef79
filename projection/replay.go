package projection

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// ReplayConfig configures ReplayFunc.
type ReplayConfig struct {
	// Decoder decodes the quarantined bytes; nil = the default v1 decoder.
	// Teach it a new wire version through its Upgraders.
	Decoder *event.Decoder
	// ArchiveTTL and SnapshotRoots as in Config.
	ArchiveTTL    map[string]time.Duration
	SnapshotRoots []string
	// JetStream reads large rows (row_ref); nil makes such events fail
	// (they stay in quarantine).
	JetStream jetstream.JetStream
	// MaxRowBytes as in Config: a larger row stays quarantined (oversized).
	MaxRowBytes int64
}

// ReplayFunc returns the quarantine.ApplyFunc that applies a quarantined
// event, decoded with the current code, to the read model of its version,
// in the replay's transaction — exactly what the runtime would have done:
// a row is archived (idempotently; the snapshots of its transaction are
// rebuilt, and its transaction's roots recomputed if its commit was
// applied already); a commit marks its transaction's roots and creates its
// snapshot jobs; other messages need nothing.
func ReplayFunc(cfg ReplayConfig) quarantine.ApplyFunc {
	dec := cfg.Decoder
	if dec == nil {
		dec = &event.Decoder{}
	}
	c := Config{ArchiveTTL: cfg.ArchiveTTL}
	objects := newObjectReader(cfg.JetStream)
	return func(ctx context.Context, tx pgx.Tx, e quarantine.Entry) error {
		if e.Projection != ArchiveProjection {
			return fmt.Errorf("replay: projection %q is not known to this projector", e.Projection)
		}
		var schema string
		err := tx.QueryRow(ctx, `SELECT schema_name FROM epitaph.projection_versions WHERE projection = $1 AND version = $2`,
			e.Projection, e.Version).Scan(&schema)
		if err != nil {
			return fmt.Errorf("replay: version %d of %s: %w", e.Version, e.Projection, err)
		}
		if e.Category == CategoryUnauthenticated {
			// Replaying one message alone would skip its verification.
			return quarantine.Permanent(quarantine.CategoryUnauthenticated, fmt.Errorf("not replayed: it failed verification (trust.go); "+
				"if its key is trusted now (projector trust-key), rebuild the version, which verifies the stream again; else discard it"))
		}
		ev, err := dec.Decode(e.Data)
		if err != nil {
			return err
		}
		switch ev.Op {
		case event.OpDelete:
			r := &archiveRow{ev: ev, row: ev.Row}
			if ev.RowRef != nil {
				if r.row, err = fetchLimited(ctx, objects, ev.RowRef, cfg.MaxRowBytes); err != nil {
					return err
				}
			}
			if d, ok := c.ttlFor(ev.QualifiedTable()); ok && !ev.CommitTime.IsZero() {
				t := ev.CommitTime.Add(d)
				r.expiresAt = &t
			}
			// An erased row is not archived again (fence.go).
			fs := &fenceSet{}
			keep, _, fenced, parents, err := fs.filter(ctx, tx, []*archiveRow{r})
			if err != nil {
				return err
			}
			if len(parents) > 0 {
				// Its children archived meanwhile go with it.
				if _, err := fs.record(ctx, tx, schema, parents); err != nil {
					return err
				}
			}
			if len(keep) == 0 {
				return nil
			}
			counted, epoch, err := insertRowsCounted(ctx, tx, schema, keep)
			if err != nil {
				return err
			}
			if epoch != fenced {
				return errFencesChanged // an erasure meanwhile: replay again
			}
			if len(counted) == 0 {
				return nil
			}
			inserted := make([]string, len(counted))
			for i, t := range counted {
				inserted[i] = t.correlationID
			}
			var committed bool
			err = tx.QueryRow(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s.rows
				WHERE source = $1 AND commit_lsn = $2::pg_lsn AND is_root IS NOT NULL)`, ident(schema)),
				ev.Source, ev.CommitLSN.String()).Scan(&committed)
			if err != nil {
				return fmt.Errorf("replay: look up transaction: %w", err)
			}
			if committed {
				if err := markRoots(ctx, tx, schema, ev.Source, []event.LSN{ev.CommitLSN}, false); err != nil {
					return err
				}
			}
			_, err = snapshot.Invalidate(ctx, tx, schema, inserted)
			return err
		case event.OpCommit:
			if err := markRoots(ctx, tx, schema, ev.Source, []event.LSN{ev.CommitLSN}, false); err != nil {
				return err
			}
			_, err := snapshot.CreateJobs(ctx, tx, schema, ev, cfg.SnapshotRoots)
			return err
		default:
			return nil
		}
	}
}
