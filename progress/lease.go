package progress

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// Leaser takes, renews and gives back partition leases for one worker, and
// keeps the worker's heartbeat in epitaph.workers so that workers share the
// partitions fairly: each claims up to ceil(P / live workers) partitions of
// a version. A worker is live while its heartbeat is younger than its TTL.
type Leaser struct {
	db     DB
	worker string
	ttl    time.Duration
}

// NewLeaser returns a Leaser for worker with leases lasting ttl.
func NewLeaser(db DB, worker string, ttl time.Duration) (*Leaser, error) {
	if worker == "" {
		return nil, errors.New("leaser: worker id is required")
	}
	if ttl <= 0 {
		return nil, errors.New("leaser: lease TTL must be positive")
	}
	return &Leaser{db: db, worker: worker, ttl: ttl}, nil
}

// Worker is the worker id leases are taken for.
func (l *Leaser) Worker() string { return l.worker }

// TTL is the lease duration.
func (l *Leaser) TTL() time.Duration { return l.ttl }

func (l *Leaser) ttlMicros() int64 { return l.ttl.Microseconds() }

// Heartbeat records that the worker is alive.
func (l *Leaser) Heartbeat(ctx context.Context) error {
	_, err := l.db.Exec(ctx, `
		INSERT INTO epitaph.workers (worker_id, heartbeat_at, lease_ttl)
		VALUES ($1, now(), $2 * interval '1 microsecond')
		ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = now(), lease_ttl = EXCLUDED.lease_ttl`,
		l.worker, l.ttlMicros())
	if err != nil {
		return fmt.Errorf("heartbeat of worker %s: %w", l.worker, err)
	}
	return nil
}

// PruneWorkers forgets workers whose last heartbeat is older than age
// (processes that died without deregistering). It returns how many.
func (l *Leaser) PruneWorkers(ctx context.Context, age time.Duration) (int64, error) {
	tag, err := l.db.Exec(ctx, `DELETE FROM epitaph.workers WHERE heartbeat_at < now() - $1 * interval '1 microsecond'`,
		age.Microseconds())
	if err != nil {
		return 0, fmt.Errorf("prune workers: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Deregister removes the worker's heartbeat so the others' fair share grows
// at once (used on a graceful stop, after Release).
func (l *Leaser) Deregister(ctx context.Context) error {
	if _, err := l.db.Exec(ctx, `DELETE FROM epitaph.workers WHERE worker_id = $1`, l.worker); err != nil {
		return fmt.Errorf("deregister worker %s: %w", l.worker, err)
	}
	return nil
}

// LiveWorkers counts workers whose heartbeat is within their TTL, this one
// included even before its first heartbeat.
func (l *Leaser) LiveWorkers(ctx context.Context) (int, error) {
	var n int
	err := l.db.QueryRow(ctx, `
		SELECT count(*) + (NOT EXISTS (SELECT 1 FROM epitaph.workers WHERE worker_id = $1
		                                AND heartbeat_at > now() - lease_ttl))::int
		FROM epitaph.workers WHERE heartbeat_at > now() - lease_ttl`, l.worker).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count live workers: %w", err)
	}
	return n, nil
}

// FairShare is how many of partitions a worker should own: ceil(P / live).
func (l *Leaser) FairShare(ctx context.Context, partitions int) (int, error) {
	live, err := l.LiveWorkers(ctx)
	if err != nil {
		return 0, err
	}
	if live < 1 {
		live = 1
	}
	return (partitions + live - 1) / live, nil
}

// Claim takes up to n partitions of a version that have no owner or whose
// lease expired, lowest partition first. Each claim increments the epoch,
// fencing off the previous owner. Partitions being claimed by another worker
// at the same moment are skipped, never waited for.
func (l *Leaser) Claim(ctx context.Context, projection string, version, n int) ([]Lease, error) {
	return l.claim(ctx, projection, version, n, nil, false)
}

// claim is Claim; with takeBack it also takes the partitions whose lease
// still names this worker but that are not in held: the leases of an
// earlier run of the same worker id (a restart), or of a partition worker
// of this process that stopped. They are taken back at once, epoch
// incremented, instead of after their expiry (held is what this process
// runs now, which it must not fence off).
func (l *Leaser) claim(ctx context.Context, projection string, version, n int, held []Lease, takeBack bool) ([]Lease, error) {
	if n <= 0 {
		return nil, nil
	}
	_, _, parts, _ := columns(held)
	if parts == nil {
		parts = []int32{}
	}
	rows, err := l.db.Query(ctx, `
		UPDATE epitaph.progress p
		SET owner = $3, epoch = p.epoch + 1, lease_expires_at = now() + $5 * interval '1 microsecond'
		FROM (SELECT projection, version, partition FROM epitaph.progress
		      WHERE projection = $1 AND version = $2
		        AND (owner IS NULL OR lease_expires_at IS NULL OR lease_expires_at < now()
		             OR ($6 AND owner = $3 AND partition <> ALL($7::int[])))
		      ORDER BY (owner IS DISTINCT FROM $3), partition LIMIT $4
		      FOR UPDATE SKIP LOCKED) c
		WHERE p.projection = c.projection AND p.version = c.version AND p.partition = c.partition
		RETURNING p.partition, p.epoch, p.lease_expires_at`,
		projection, version, l.worker, n, l.ttlMicros(), takeBack, parts)
	if err != nil {
		return nil, fmt.Errorf("claim partitions of %s v%d: %w", projection, version, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Lease, error) {
		ls := Lease{Key: Key{Projection: projection, Version: version}, Owner: l.worker}
		var p int32
		err := r.Scan(&p, &ls.Epoch, &ls.ExpiresAt)
		ls.Partition = int(p)
		return ls, err
	})
	if err != nil {
		return nil, fmt.Errorf("claim partitions of %s v%d: %w", projection, version, err)
	}
	return out, nil
}

// Renew extends the given leases and returns those still held (same owner
// and epoch), with their new expiry. A lease missing from the result was
// lost: its partition must stop at once.
func (l *Leaser) Renew(ctx context.Context, leases []Lease) ([]Lease, error) {
	if len(leases) == 0 {
		return nil, nil
	}
	projs, vers, parts, epochs := columns(leases)
	rows, err := l.db.Query(ctx, `
		UPDATE epitaph.progress p
		SET lease_expires_at = now() + $6 * interval '1 microsecond'
		FROM unnest($1::text[], $2::int[], $3::int[], $4::bigint[]) AS h(projection, version, partition, epoch)
		WHERE p.projection = h.projection AND p.version = h.version AND p.partition = h.partition
		  AND p.epoch = h.epoch AND p.owner = $5
		RETURNING p.projection, p.version, p.partition, p.epoch, p.lease_expires_at`,
		projs, vers, parts, epochs, l.worker, l.ttlMicros())
	if err != nil {
		return nil, fmt.Errorf("renew leases: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Lease, error) {
		ls := Lease{Owner: l.worker}
		var v, p int32
		err := r.Scan(&ls.Projection, &v, &p, &ls.Epoch, &ls.ExpiresAt)
		ls.Version, ls.Partition = int(v), int(p)
		return ls, err
	})
	if err != nil {
		return nil, fmt.Errorf("renew leases: %w", err)
	}
	return out, nil
}

// Release gives leases back at once (graceful stop, rebalancing): the
// partitions become claimable by any worker without waiting for expiry.
// Leases no longer held are ignored.
func (l *Leaser) Release(ctx context.Context, leases []Lease) error {
	if len(leases) == 0 {
		return nil
	}
	projs, vers, parts, epochs := columns(leases)
	_, err := l.db.Exec(ctx, `
		UPDATE epitaph.progress p
		SET owner = NULL, lease_expires_at = NULL
		FROM unnest($1::text[], $2::int[], $3::int[], $4::bigint[]) AS h(projection, version, partition, epoch)
		WHERE p.projection = h.projection AND p.version = h.version AND p.partition = h.partition
		  AND p.epoch = h.epoch AND p.owner = $5`,
		projs, vers, parts, epochs, l.worker)
	if err != nil {
		return fmt.Errorf("release leases: %w", err)
	}
	return nil
}

// Balance is one step of fair sharing for one version: it renews held,
// computes the fair share, and either claims free partitions up to it or
// names the excess leases the caller should stop and then Release (another
// worker joined). Partitions still leased to this worker id that are not
// in held (an earlier run of the worker that died: a restart with the same
// id) are claimed first, at once, without waiting out their lease. keep
// holds every lease the worker now owns, excess included; lost are the
// held leases that were taken over.
func (l *Leaser) Balance(ctx context.Context, projection string, version, partitions int, held []Lease) (keep, excess, lost []Lease, err error) {
	kept, err := l.Renew(ctx, held)
	if err != nil {
		return held, nil, nil, err
	}
	still := map[Key]bool{}
	for _, k := range kept {
		still[k.Key] = true
	}
	for _, h := range held {
		if !still[h.Key] {
			lost = append(lost, h)
		}
	}
	share, err := l.FairShare(ctx, partitions)
	if err != nil {
		return kept, nil, lost, err
	}
	if len(kept) > share {
		// Give back the highest partitions; keep the order stable.
		sortLeases(kept)
		return kept, append([]Lease(nil), kept[share:]...), lost, nil
	}
	claimed, err := l.claim(ctx, projection, version, share-len(kept), kept, true)
	if err != nil {
		return kept, nil, lost, err
	}
	keep = append(kept, claimed...)
	sortLeases(keep)
	return keep, nil, lost, nil
}

func sortLeases(ls []Lease) {
	slices.SortFunc(ls, func(a, b Lease) int { return cmp.Compare(a.Partition, b.Partition) })
}

func columns(ls []Lease) (projs []string, vers, parts []int32, epochs []int64) {
	for _, l := range ls {
		projs = append(projs, l.Projection)
		vers = append(vers, int32(l.Version))
		parts = append(parts, int32(l.Partition))
		epochs = append(epochs, l.Epoch)
	}
	return
}
