package revalidate

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/handler"
)

// Record writes an evaluation on its delivery, in one transaction: the
// outcome, the observed fingerprint and evaluated_at. It changes neither
// the state nor the claim (the dispatcher settles). Besides:
//   - StopChanged queues the next generation of the delivery for the
//     current set (pending, released, stamped with the set's fingerprint and
//     pair) under its new identity; its payload is the old one plus
//     "group": {"rows": the current count, "added": the keys of the rows
//     archived since the old one was queued} (bounded by what changed, not
//     by the group's size: a group's n deliveries never store n keys each).
//     Recording twice queues it once.
//   - Send after a full read that found the same set refreshes the stored
//     pair, so the next evaluation takes the cheap path again (a promotion
//     re-archives the same rows at another time).
func (e *Evaluator) Record(ctx context.Context, res Result) error {
	d := res.d
	if d.id == "" {
		return nil // nothing was read (the target was unreadable)
	}
	return pgx.BeginFunc(ctx, e.db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE epitaph.deliveries
			SET outcome = $2, observed_fingerprint = COALESCE(NULLIF($3, ''), observed_fingerprint),
			    evaluated_at = now(), updated_at = now()
			WHERE id = $1`, d.id, string(res.Outcome), res.ObservedFingerprint); err != nil {
			return fmt.Errorf("record revalidation of %s: %w", d.id, err)
		}
		switch {
		case res.Outcome == StopChanged:
			return queueNext(ctx, tx, d, res.current)
		case res.Outcome == Send && res.Path == PathFull:
			if _, err := tx.Exec(ctx, `UPDATE epitaph.deliveries SET group_rows = $2, group_max = $3,
				fingerprint = COALESCE(fingerprint, $4) WHERE id = $1`,
				d.id, res.current.rows, res.current.max, res.current.fingerprint); err != nil {
				return fmt.Errorf("refresh the pair of %s: %w", d.id, err)
			}
		}
		return nil
	})
}

const queueNextSQL = `
INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, generation, schema_name, table_name, key,
    correlation_id, commit_time, version, phase, priority, state, released_at, payload,
    fingerprint, group_rows, group_max)
SELECT $2::uuid, handler_id, source, commit_lsn, seq, generation + 1, schema_name, table_name, key,
       correlation_id, commit_time, version, phase, priority, 'pending', now(),
       CASE WHEN jsonb_typeof(payload) = 'object'
            THEN payload || jsonb_build_object('group', jsonb_build_object('rows', $5::int, 'added', $3::jsonb)) END,
       $4, $5, $6
FROM epitaph.deliveries WHERE id = $1
ON CONFLICT (handler_id, source, commit_lsn, seq, generation) DO NOTHING`

// queueNext inserts generation+1 of a changed delivery for the set s.
func queueNext(ctx context.Context, tx pgx.Tx, d delivery, s set) error {
	id := handler.DeliveryID(d.handlerID, d.source, d.lsn, d.seq, d.generation+1)
	if _, err := tx.Exec(ctx, queueNextSQL, d.id, id, string(s.added), s.fingerprint, s.rows, s.max); err != nil {
		return fmt.Errorf("queue generation %d of %s: %w", d.generation+1, d.id, err)
	}
	return nil
}
