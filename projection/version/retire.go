package version

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
)

// RetireOptions say how a version is retired.
type RetireOptions struct {
	Source string
	// Drop drops the version's schema (its rows and snapshots) too.
	Drop bool
	// WaitReleased bounds the wait for workers to hand the version's
	// partitions back (they notice on their next balance) before its
	// consumers are deleted. Default 30s; leases of dead workers expire.
	WaitReleased time.Duration
	// Group is the consumer group whose consumers are deleted besides the
	// ones recorded on the progress rows; default the target's
	// (DefaultGroup).
	Group string
}

// Retire takes a version out of service: it refuses the live version; it
// marks the version retired (workers stop its partitions on their next
// balance), waits for its leases to be given back or expire, deletes its
// JetStream consumers, deletes its progress rows (the consumer identity is
// never reused, so there is nothing to resume), resolves its open
// quarantine as discarded ("version retired"; the rows are kept as the
// audit record), and with Drop drops its schema. Retiring a retired
// version again finishes the cleanup.
func Retire(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, name string, version int, opts RetireOptions) error {
	if opts.Source == "" {
		opts.Source = "main"
	}
	if opts.WaitReleased == 0 {
		opts.WaitReleased = 30 * time.Second
	}
	v, err := markRetired(ctx, pool, name, version)
	if err != nil {
		return fmt.Errorf("retire %s v%d: %w", name, version, err)
	}
	if err := waitReleased(ctx, pool, v, opts.WaitReleased); err != nil {
		return fmt.Errorf("retire %s v%d: %w", name, version, err)
	}
	if js != nil {
		if err := deleteVersionConsumers(ctx, pool, js, v, opts); err != nil {
			return fmt.Errorf("retire %s v%d: %w", name, version, err)
		}
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `DELETE FROM epitaph.progress WHERE projection = $1 AND version = $2`, name, version); err != nil {
			return fmt.Errorf("retire %s v%d: delete progress: %w", name, version, err)
		}
		// Nothing can replay into a retired version: its open quarantine
		// is resolved (kept as the audit record) so it stops counting as
		// unresolved.
		if _, err := tx.Exec(ctx, `UPDATE epitaph.quarantine
			SET status = 'discarded', resolved_at = now(), resolution_reason = 'version retired'
			WHERE projection = $1 AND version = $2 AND status = 'open'`, name, version); err != nil {
			return fmt.Errorf("retire %s v%d: resolve its quarantine: %w", name, version, err)
		}
		if opts.Drop {
			if _, err := tx.Exec(ctx, `DROP SCHEMA IF EXISTS `+ident(v.Schema)+` CASCADE`); err != nil {
				return fmt.Errorf("retire %s v%d: drop schema %s: %w", name, version, v.Schema, err)
			}
		}
		return nil
	})
}

// markRetired marks the version retired (refusing the live one) under the
// version lock.
func markRetired(ctx context.Context, pool *pgxpool.Pool, name string, version int) (Version, error) {
	var v Version
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := LockVersions(ctx, tx); err != nil {
			return err
		}
		var err error
		if v, err = GetVersion(ctx, tx, name, version); err != nil {
			return err
		}
		if v.State == StateLive {
			return fmt.Errorf("%s v%d is live: promote another version (or roll back) first", name, version)
		}
		_, err = tx.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'retired', retired_at = COALESCE(retired_at, now())
			WHERE projection = $1 AND version = $2`, name, version)
		return err
	})
	return v, err
}

// waitReleased waits, up to limit, until no live lease holds a partition
// of the version.
func waitReleased(ctx context.Context, pool *pgxpool.Pool, v Version, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		var held int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.progress WHERE projection = $1 AND version = $2
			AND owner IS NOT NULL AND lease_expires_at > now()`, v.Projection, v.Version).Scan(&held); err != nil {
			return fmt.Errorf("count leases: %w", err)
		}
		if held == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d partitions still leased after %s (retry to finish the cleanup)", held, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// deleteVersionConsumers deletes every consumer the version's partitions
// may have: the one recorded on its progress row (with its random part),
// and the names of older releases, the group's without a random part and
// the one from before consumer groups.
func deleteVersionConsumers(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, v Version, opts RetireOptions) error {
	stream, err := js.Stream(ctx, event.StreamName(opts.Source))
	if err != nil {
		return fmt.Errorf("stream: %w", err)
	}
	group := opts.Group
	if group == "" {
		if group, err = DefaultGroup(ctx, pool); err != nil {
			return err
		}
	} else if err := ValidateGroup(group); err != nil {
		return err
	}
	rows, err := progress.List(ctx, pool, v.Projection, v.Version)
	if err != nil {
		return err
	}
	recorded := map[int]string{}
	n := v.Partitions
	for _, r := range rows {
		recorded[r.Partition] = r.Consumer
		if v.Partitions == 0 {
			n = max(n, r.Partition+1)
		}
	}
	for p := 0; p < n; p++ {
		k := progress.Key{Projection: v.Projection, Version: v.Version, Partition: p}
		names := []string{recorded[p], k.GroupConsumerName(group), k.ConsumerName()}
		for i, c := range names {
			if c == "" || slices.Contains(names[:i], c) {
				continue
			}
			if err := stream.DeleteConsumer(ctx, c); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
				return fmt.Errorf("delete consumer %s: %w", c, err)
			}
		}
	}
	return nil
}
