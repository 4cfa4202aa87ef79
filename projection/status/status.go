package status

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Status is the /status document of the projector (and `projector status`).
type Status struct {
	// Worker is the worker that produced the document ("" from the CLI).
	Worker     string          `json:"worker,omitempty"`
	Source     string          `json:"source"`
	Stream     string          `json:"stream"`
	StreamLast uint64          `json:"stream_last_seq"`
	Partitions int             `json:"partitions"`
	Versions   []VersionStatus `json:"versions"`
	Workers    []WorkerStatus  `json:"workers"`
	// Quarantine holds unresolved quarantine per version and category
	// (absent when the quarantine table does not exist).
	Quarantine []QuarantineStatus `json:"quarantine,omitempty"`
	// StreamError says why stream positions (lag) are missing.
	StreamError string    `json:"stream_error,omitempty"`
	At          time.Time `json:"at"`
}

// VersionStatus is one projection version.
type VersionStatus struct {
	Projection string `json:"projection"`
	Version    int    `json:"version"`
	State      string `json:"state"`
	// Health is the state, or "quarantined" (unresolved quarantine) or
	// "unavailable" (a partition without a live lease, or failing 3 times
	// in a row) when that is worse.
	Health    string `json:"health"`
	Schema    string `json:"schema"`
	LagEvents uint64 `json:"lag_events"`
	// LagUnknown, when set, says why the lag of the version (some of
	// its partitions) could not be measured: the lag fields are then null
	// in JSON and "unknown" for people, never a 0 nobody measured.
	LagUnknown              string            `json:"lag_unknown,omitempty"`
	OldestPendingAgeSeconds float64           `json:"oldest_pending_age_seconds"`
	QuarantineOpen          int               `json:"quarantine_open"`
	Partitions              []PartitionStatus `json:"partitions"`
	// Lifecycle: boundary, transitions, rebuild progress (VersionLifecycle).
	Lifecycle *VersionLifecycle `json:"lifecycle,omitempty"`
	// Readiness as archive.status says it (Readiness): ready, why not,
	// and how far into the source the version is complete.
	Ready            bool       `json:"ready"`
	NotReadyReasons  []string   `json:"not_ready_reasons,omitempty"`
	CompleteUpToLSN  string     `json:"complete_up_to_lsn,omitempty"`
	CompleteUpToTime *time.Time `json:"complete_up_to_time,omitempty"`
	// Gaps: what the version is known to miss (archive_v<N>.gaps): the
	// unacknowledged blocking ones and the most recent others, at most
	// maxStatusGaps; GapCounts counts them all.
	Gaps      []archive.Gap `json:"gaps"`
	GapCounts []GapCount    `json:"gap_counts"`
}

// GapCount is how many gaps of a kind a version has, acknowledged or not.
type GapCount struct {
	Kind         string `json:"kind"`
	Acknowledged bool   `json:"acknowledged"`
	Count        int    `json:"count"`
}

// maxStatusGaps bounds the gaps listed per version in the status document.
const maxStatusGaps = 50

// PartitionStatus is one partition of a version.
type PartitionStatus struct {
	Partition      int        `json:"partition"`
	Owner          string     `json:"owner,omitempty"`
	Epoch          int64      `json:"epoch"`
	Leased         bool       `json:"leased"`
	LeaseExpiresAt *time.Time `json:"lease_expires_at,omitempty"`
	Cursor         uint64     `json:"cursor"`
	SourceLSN      string     `json:"source_lsn,omitempty"`
	LagEvents      uint64     `json:"lag_events"`
	// LagUnknown, when set, says why the partition's lag could not be
	// measured (the lag fields are null in JSON).
	LagUnknown string `json:"lag_unknown,omitempty"`
	// LagSeconds is how long the oldest unapplied event has been in the
	// stream (0 when caught up); same as OldestPendingAgeSeconds.
	LagSeconds              float64    `json:"lag_seconds"`
	OldestPendingAt         *time.Time `json:"oldest_pending_at,omitempty"`
	OldestPendingAgeSeconds float64    `json:"oldest_pending_age_seconds"`
	LastAdvanceAt           *time.Time `json:"last_advance_at,omitempty"`
	Attempts                int        `json:"attempts"`
	LastFailureCategory     string     `json:"last_failure_category,omitempty"`
	// NextSeq is the stream sequence of the partition's oldest unapplied
	// message (0 when caught up).
	NextSeq uint64 `json:"next_seq,omitempty"`
	// ReachedBoundary: the partition applied all its messages up to the
	// version's boundary.
	ReachedBoundary bool `json:"reached_boundary"`
}

// QuarantineStatus is the unresolved quarantine of one version.
type QuarantineStatus struct {
	Projection       string         `json:"projection"`
	Version          int            `json:"version"`
	Unresolved       int            `json:"unresolved"`
	ByCategory       map[string]int `json:"by_category"`
	OldestAgeSeconds float64        `json:"oldest_age_seconds"`
}

// WorkerStatus is one registered worker.
type WorkerStatus struct {
	ID                  string    `json:"id"`
	HeartbeatAt         time.Time `json:"heartbeat_at"`
	HeartbeatAgeSeconds float64   `json:"heartbeat_age_seconds"`
	Live                bool      `json:"live"`
}

// CollectStatus reads the status of every version of the projections of
// source from the target database and the stream. It only reads; without
// a stream (js nil or unreachable) StreamError says why and every active
// version's and partition's lag is unknown (LagUnknown).
func CollectStatus(ctx context.Context, db progress.DB, js jetstream.JetStream, source string, now time.Time) (*Status, error) {
	st := &Status{Source: source, Stream: event.StreamName(source), At: now}
	vs, err := version.ListVersions(ctx, db, "")
	if err != nil {
		return nil, err
	}
	if st.Workers, err = listWorkers(ctx, db); err != nil {
		return nil, err
	}
	if st.Quarantine, err = quarantineStatus(ctx, db); err != nil {
		return nil, err
	}
	open := map[version.VersionKey]int{}
	for _, q := range st.Quarantine {
		open[version.VersionKey{Projection: q.Projection, Version: q.Version}] += q.Unresolved
	}
	stream := st.readStream(ctx, js)
	var dbNow time.Time
	if err := db.QueryRow(ctx, `SELECT now()`).Scan(&dbNow); err != nil {
		return nil, fmt.Errorf("read database time: %w", err)
	}
	for _, v := range vs {
		vst := VersionStatus{Projection: v.Projection, Version: v.Version, State: v.State, Health: v.State, Schema: v.Schema,
			QuarantineOpen: open[v.Key()]}
		if v.State != version.StateRetired {
			if err := st.collectVersion(ctx, db, stream, v, &vst, dbNow); err != nil {
				return nil, err
			}
		}
		st.Versions = append(st.Versions, vst)
	}
	if err := st.addReadiness(ctx, db); err != nil {
		return nil, err
	}
	return st, nil
}

// SetStreamError replaces why the stream could not be read (reason: the
// connection error of a caller that had none to give CollectStatus); every
// lag that was unknown for want of the stream says so.
func (st *Status) SetStreamError(reason string) {
	old := st.StreamError
	st.StreamError = reason
	for i := range st.Versions {
		v := &st.Versions[i]
		if v.LagUnknown == old && old != "" {
			v.LagUnknown = reason
		}
		for j := range v.Partitions {
			if p := &v.Partitions[j]; p.LagUnknown == old && old != "" {
				p.LagUnknown = reason
			}
		}
	}
}

// LagsUnknown lists, one line each, the active versions whose lag could
// not be measured, with why.
func (st *Status) LagsUnknown() []string {
	var out []string
	for _, v := range st.Versions {
		if v.LagUnknown != "" {
			out = append(out, fmt.Sprintf("%s v%d lag unknown: %s", v.Projection, v.Version, v.LagUnknown))
		}
	}
	return out
}

// MarshalJSON writes the version with null lags when they are unknown or
// not measured (a retired version).
func (v VersionStatus) MarshalJSON() ([]byte, error) {
	type plain VersionStatus
	if v.LagUnknown == "" && v.State != version.StateRetired {
		return json.Marshal(plain(v))
	}
	return json.Marshal(struct {
		plain
		LagEvents               *uint64  `json:"lag_events"`
		OldestPendingAgeSeconds *float64 `json:"oldest_pending_age_seconds"`
	}{plain: plain(v)})
}

// MarshalJSON writes the partition with null lags when they are unknown.
func (p PartitionStatus) MarshalJSON() ([]byte, error) {
	type plain PartitionStatus
	if p.LagUnknown == "" {
		return json.Marshal(plain(p))
	}
	return json.Marshal(struct {
		plain
		LagEvents               *uint64  `json:"lag_events"`
		LagSeconds              *float64 `json:"lag_seconds"`
		OldestPendingAgeSeconds *float64 `json:"oldest_pending_age_seconds"`
	}{plain: plain(p)})
}

// listWorkers reads the registered workers and whether their heartbeat
// is live.
func listWorkers(ctx context.Context, db progress.DB) ([]WorkerStatus, error) {
	rows, err := db.Query(ctx, `SELECT worker_id, heartbeat_at, heartbeat_at > now() - lease_ttl,
		extract(epoch FROM now() - heartbeat_at)::float8 FROM epitaph.workers ORDER BY worker_id`)
	if err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	ws, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (WorkerStatus, error) {
		var w WorkerStatus
		err := r.Scan(&w.ID, &w.HeartbeatAt, &w.Live, &w.HeartbeatAgeSeconds)
		return w, err
	})
	if err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	return ws, nil
}

// quarantineStatus reads the unresolved quarantine per version (nil when
// the quarantine table does not exist).
func quarantineStatus(ctx context.Context, db progress.DB) ([]QuarantineStatus, error) {
	stats, err := quarantine.Stats(ctx, db)
	if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) && pe.Code == "42P01" {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("quarantine stats: %w", err)
	}
	var out []QuarantineStatus
	for _, q := range stats {
		qs := QuarantineStatus{Projection: q.Projection, Version: q.Version, Unresolved: q.Unresolved,
			ByCategory: map[string]int{}, OldestAgeSeconds: q.OldestAge.Seconds()}
		for c, n := range q.ByCategory {
			qs.ByCategory[string(c)] = n
		}
		out = append(out, qs)
	}
	return out, nil
}

// readStream looks the source's stream up and sets its last sequence and
// partitions; nil (StreamError says why) without one.
func (st *Status) readStream(ctx context.Context, js jetstream.JetStream) jetstream.Stream {
	if js == nil {
		st.StreamError = "no stream connection"
		return nil
	}
	stream, err := js.Stream(ctx, st.Stream)
	if err != nil {
		st.StreamError = err.Error()
		return nil
	}
	info := stream.CachedInfo()
	st.StreamLast = info.State.LastSeq
	st.Partitions, _ = version.StreamPartitions(info)
	return stream
}

// collectVersion fills the status of an active version: its partitions
// (leases, positions, lag), lifecycle, gaps and health. dbNow is the
// database's time (leases), st.At the clock of the ages.
func (st *Status) collectVersion(ctx context.Context, db progress.DB, stream jetstream.Stream, v version.Version, vst *VersionStatus, dbNow time.Time) error {
	prs, err := progress.List(ctx, db, v.Projection, v.Version)
	if err != nil {
		return err
	}
	unavailable := len(prs) == 0
	for _, r := range prs {
		ps := PartitionStatus{Partition: r.Partition, Owner: r.Owner, Epoch: r.Epoch, LeaseExpiresAt: r.LeaseExpiresAt,
			Cursor: r.Cursor, LastAdvanceAt: r.LastAdvanceAt, Attempts: r.Attempts, LastFailureCategory: r.LastFailureCategory}
		ps.Leased = r.Owner != "" && r.LeaseExpiresAt != nil && r.LeaseExpiresAt.After(dbNow)
		if r.SourceLSN != 0 {
			ps.SourceLSN = r.SourceLSN.String()
		}
		if !ps.Leased || r.Attempts >= archive.FailingAttempts {
			unavailable = true
		}
		if stream == nil {
			ps.LagUnknown = st.StreamError
		} else if err := PartitionLag(ctx, stream, st.Source, r, &ps, st.At); err != nil {
			st.StreamError = err.Error()
			ps = PartitionStatus{Partition: ps.Partition, Owner: ps.Owner, Epoch: ps.Epoch, Leased: ps.Leased,
				LeaseExpiresAt: ps.LeaseExpiresAt, Cursor: ps.Cursor, SourceLSN: ps.SourceLSN, LastAdvanceAt: ps.LastAdvanceAt,
				Attempts: ps.Attempts, LastFailureCategory: ps.LastFailureCategory, LagUnknown: err.Error()}
		}
		if ps.LagUnknown != "" && vst.LagUnknown == "" {
			vst.LagUnknown = ps.LagUnknown
		}
		vst.LagEvents += ps.LagEvents
		vst.OldestPendingAgeSeconds = max(vst.OldestPendingAgeSeconds, ps.OldestPendingAgeSeconds)
		vst.Partitions = append(vst.Partitions, ps)
	}
	if stream == nil {
		vst.LagUnknown = st.StreamError
	}
	vst.Lifecycle = lifecycleOf(v, vst, stream)
	if err := gapStatus(ctx, db, v, vst); err != nil {
		return err
	}
	switch {
	case unavailable:
		vst.Health = "unavailable"
	case vst.QuarantineOpen > 0:
		vst.Health = "quarantined"
	}
	return nil
}

// addReadiness sets each version's readiness as archive.status says it.
func (st *Status) addReadiness(ctx context.Context, db progress.DB) error {
	rs, err := ReadReadiness(ctx, db, "")
	if err != nil {
		return err
	}
	for _, r := range rs {
		for i := range st.Versions {
			if vst := &st.Versions[i]; vst.Projection == r.Projection && vst.Version == r.Version {
				vst.Ready, vst.NotReadyReasons = r.Ready, r.NotReadyReasons
				vst.CompleteUpToLSN, vst.CompleteUpToTime = r.CompleteUpToLSN, r.CompleteUpToTime
			}
		}
	}
	return nil
}

// gapStatus fills the gaps of one version.
func gapStatus(ctx context.Context, db progress.DB, v version.Version, vst *VersionStatus) error {
	gs, err := listGaps(ctx, db, v.Schema, `id IN (SELECT id FROM `+archive.Ident(v.Schema, "gaps")+`
		ORDER BY (acknowledged_at IS NULL AND kind <> 'truncate') DESC, id DESC LIMIT $1)`, 0, maxStatusGaps)
	if err != nil {
		return err
	}
	vst.Gaps = append([]archive.Gap{}, gs...)
	vst.GapCounts = []GapCount{}
	if len(gs) == 0 {
		return nil
	}
	rows, err := db.Query(ctx, `SELECT kind, acknowledged_at IS NOT NULL, count(*)::int FROM `+archive.Ident(v.Schema, "gaps")+`
		GROUP BY 1, 2 ORDER BY 1, 2`)
	if err != nil {
		return fmt.Errorf("count gaps of %s: %w", v.Schema, err)
	}
	vst.GapCounts, err = pgx.CollectRows(rows, pgx.RowToStructByPos[GapCount])
	if err != nil {
		return fmt.Errorf("count gaps of %s: %w", v.Schema, err)
	}
	return nil
}

// PartitionLag fills the lag of one partition: the first message of the
// partition after the cursor (its stream time is the oldest pending), and
// the count of pending messages from the consumer (from the stream's
// per-subject counts when there is no consumer yet).
func PartitionLag(ctx context.Context, stream jetstream.Stream, source string, r progress.Row, ps *PartitionStatus, now time.Time) error {
	filter := event.PartitionFilter(source, r.Partition)
	raw, err := stream.GetMsg(ctx, r.Cursor+1, jetstream.WithGetMsgSubject(filter))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil // caught up
	}
	if err != nil {
		return fmt.Errorf("oldest pending of partition %d: %w", r.Partition, err)
	}
	t := raw.Time
	ps.NextSeq = raw.Sequence
	ps.OldestPendingAt = &t
	ps.OldestPendingAgeSeconds = max(0, now.Sub(t).Seconds())
	ps.LagSeconds = ps.OldestPendingAgeSeconds
	c, err := stream.Consumer(ctx, version.UnitConsumer(r, ""))
	if err == nil {
		// The consumer trails the cursor by at most the page in flight:
		// what it has not had acknowledged is the lag.
		info := c.CachedInfo()
		ps.LagEvents = max(info.NumPending+uint64(info.NumAckPending), 1)
		return nil
	}
	// No consumer yet: count what the stream holds of the partition (exact
	// for a partition never applied, an upper bound otherwise).
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(filter))
	if err != nil {
		return fmt.Errorf("count partition %d: %w", r.Partition, err)
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	ps.LagEvents = max(n, 1)
	return nil
}
