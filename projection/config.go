package projection

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
	"github.com/epitaph-dev/epitaph/projection/retention"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// MaxBatchSize is the largest page a partition fetches and applies in one
// transaction.
const MaxBatchSize = 500

// Config of a projector worker. Zero values take the documented defaults.
type Config struct {
	// TargetURL is the Postgres database the read models are written to.
	TargetURL string
	// NATSURL is the JetStream server holding the source's stream.
	NATSURL string
	// NATSAuth authenticates to it: a creds file (the capture's embedded
	// broker writes <data-dir>/nats/projector.creds), an nkey seed file, a
	// user with a password file, TLS files.
	NATSAuth natsconn.Auth
	// SourceName names the source (stream EPITAPH_<SOURCE>); default "main".
	SourceName string
	// Group is the consumer group: the JetStream durable consumers are
	// <group>_<projection>-v<N>-p<p>, so projectors writing to different
	// targets from one stream never share one. Default (empty):
	// DefaultGroup of the target, the first 8 hex digits of sha256 of
	// "<system_identifier>/<database name>". Letters, digits, '-' only.
	Group string
	// WorkerID identifies this worker in leases; required (cmd/ defaults it
	// to hostname-pid).
	WorkerID string
	// LeaseTTL is how long a partition lease lasts without renewal; a dead
	// worker's partitions are taken over after it. Default 15s.
	LeaseTTL time.Duration
	// BalanceInterval is how often leases are renewed and rebalanced.
	// Default LeaseTTL/3.
	BalanceInterval time.Duration
	// BatchSize is the most events fetched and applied in one transaction:
	// 1..500, default 500.
	BatchSize int
	// FetchWait is how long an idle partition waits for events per fetch.
	// Default 1s (at most LeaseTTL/3).
	FetchWait time.Duration
	// ArchiveTTL maps "schema.table" (or "*" for every other table) to how
	// long archived rows are kept: expires_at = commit_time + TTL. A table
	// with no entry (and no "*") is kept forever (expires_at NULL).
	ArchiveTTL map[string]time.Duration
	// CleanupInterval is how often the retention worker (package retention)
	// looks for expired rows when the last batch was not full; default
	// 10s, negative: this process deletes nothing (it only measures the rows
	// due, for epitaph_projector_expired_oldest_seconds).
	CleanupInterval time.Duration
	// CleanupBatch is the retention worker's first batch size (it adapts);
	// CleanupTimeout its statement timeout (default 10s).
	CleanupBatch   int
	CleanupTimeout time.Duration
	// CleanupRate paces the retention worker while this projector applies
	// (rows per second; a batch is then at most a quarter second of it):
	// default DefaultCleanupRate, negative: unpaced. Unpaced while idle,
	// and while catching up (its batches an hour behind for an hour).
	CleanupRate int
	// ArchivePartition is the partition period (day, week, month; ""
	// month) of the rows of archive version 1 when this worker creates it;
	// every later version has the period it was rebuilt with.
	ArchivePartition string
	// SnapshotRoots are the "schema.table" root tables of snapshot
	// documents; empty = no snapshots.
	SnapshotRoots []string
	// MaxBackoff caps the exponential backoff of transient failures.
	// Default 30s.
	MaxBackoff time.Duration
	// TargetTCPTimeout bounds how long what the projector sends to the
	// target (a page, a lease renewal, a keepalive probe) may stay
	// unacknowledged before the connection is given up: every target
	// connection is dialled with TCP_USER_TIMEOUT set to it and TCP
	// keepalive probes every half of it, at most 15 s (Linux; other
	// systems keep their own behaviour). A path to the target that dies
	// without a FIN or RST (a managed Postgres failing over to another
	// address, a NAT forgetting the flow) then fails the page about this
	// long after it was sent, and the partition retries on a new
	// connection, instead of hanging until TCP gives up after about 15
	// minutes. Default DefaultTargetTCPTimeout; negative: the system's
	// default. At least 1s, at most 24h.
	TargetTCPTimeout time.Duration
	// MaxConns bounds the target connection pool; set, it overrides
	// pool_max_conns of TargetURL. Default: pool_max_conns of TargetURL
	// (pgx's default without it), raised to at least 20.
	MaxConns int32
	// Decoder decodes messages; nil = the default v1 decoder. Set its
	// Upgraders to teach the projector a newer wire version.
	Decoder *event.Decoder
	// StatusInterval is how often lag metrics are refreshed. Default 5s.
	StatusInterval time.Duration
	// RebuildShare bounds what versions being built or caught up may use
	// of this worker while the live version is busy (applied a page within the
	// last second), so a rebuild never starves it: at most
	// ceil(RebuildShare x P) of their pages (P: the stream's partitions)
	// are applied at once; pages of the live version never wait. While the
	// live version is idle, a rebuild runs unbounded. 0 < share <= 1;
	// default 0.5.
	RebuildShare float64
	// ReadyMaxLag and ReadyMaxPendingAge are when a catching_up version
	// becomes ready: its events not yet applied (over all partitions) at
	// most ReadyMaxLag (default 1000) and its oldest unapplied event at
	// most ReadyMaxPendingAge old (default 30s), with no unresolved
	// quarantine. A ready version that falls behind twice as far goes back
	// to catching_up.
	ReadyMaxLag        uint64
	ReadyMaxPendingAge time.Duration
	// SideEffects, when set, is called after each page of the LIVE version
	// is committed, with the events the page applied. It is the one hook
	// for anything acting outside the read model (notifications, calls to
	// other systems): it is never called for a version being built, caught
	// up or kept ready for rollback, so a rebuild replays history without
	// acting on it again. At most once per page (the page is committed
	// before the call; a worker that dies in between does not call it
	// again); a version promoted or demoted is seen as such within a
	// BalanceInterval. An error is logged and counted, not retried.
	SideEffects func(ctx context.Context, page SideEffectPage) error
	// HoldOnQuarantine turns on hold mode (holdonquarantine.go): a delete event whose
	// source row (schema, table, key) has an open quarantine entry, or an
	// earlier event in the same page being quarantined, is quarantined as
	// "held" instead of applied, so the order per row is kept; replay
	// releases held entries in stream order. Off (default): no extra work.
	HoldOnQuarantine bool
	// MaxRowBytes is the largest large-row object (event.ObjectRef.Size)
	// that is fetched; a bigger one is quarantined as "oversized" without
	// being read. Default DefaultMaxRowBytes (256 MiB).
	MaxRowBytes int64
	// VerifyWindowBytes bounds the memory of verification's slow path
	// (verify.go): the messages of a transaction whose rows failed the
	// fast check that it reads back from the stream, each counted as its
	// body and windowMsgOverhead. A transaction that needs more is not
	// guessed at: its partition stops there with a transient error
	// (kind verify_window) until the bound is raised. Default
	// DefaultVerifyWindowBytes (256 MiB).
	VerifyWindowBytes int64
}

// Defaults of the Config fields left zero, which the projector command's
// flags show.
const (
	DefaultSourceName         = "main"
	DefaultLeaseTTL           = 15 * time.Second
	DefaultRebuildShare       = 0.5
	DefaultReadyMaxLag        = 1000
	DefaultReadyMaxPendingAge = 30 * time.Second
	DefaultTargetTCPTimeout   = 30 * time.Second
	DefaultVerifyWindowBytes  = int64(256 << 20)
)

func (c *Config) setDefaults() {
	if c.SourceName == "" {
		c.SourceName = DefaultSourceName
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.BalanceInterval == 0 {
		c.BalanceInterval = c.LeaseTTL / 3
	}
	if c.BatchSize == 0 {
		c.BatchSize = MaxBatchSize
	}
	if c.FetchWait == 0 {
		c.FetchWait = min(time.Second, c.LeaseTTL/3)
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = 30 * time.Second
	}
	if c.Decoder == nil {
		c.Decoder = &event.Decoder{}
	}
	if c.StatusInterval == 0 {
		c.StatusInterval = 5 * time.Second
	}
	if c.RebuildShare == 0 {
		c.RebuildShare = DefaultRebuildShare
	}
	if c.CleanupRate == 0 {
		c.CleanupRate = retention.DefaultCleanupRate
	}
	if c.ReadyMaxLag == 0 {
		c.ReadyMaxLag = DefaultReadyMaxLag
	}
	if c.ReadyMaxPendingAge == 0 {
		c.ReadyMaxPendingAge = DefaultReadyMaxPendingAge
	}
	if c.MaxRowBytes == 0 {
		c.MaxRowBytes = DefaultMaxRowBytes
	}
	if c.TargetTCPTimeout == 0 {
		c.TargetTCPTimeout = DefaultTargetTCPTimeout
	}
	if c.VerifyWindowBytes == 0 {
		c.VerifyWindowBytes = DefaultVerifyWindowBytes
	}
}

func (c *Config) validate() error {
	var errs []error
	if c.TargetURL == "" {
		errs = append(errs, errors.New("target URL is required (EPITAPH_TARGET_URL)"))
	}
	if c.NATSURL == "" {
		errs = append(errs, errors.New("NATS URL is required (EPITAPH_NATS_URL)"))
	}
	if err := c.NATSAuth.Validate(c.NATSURL); err != nil {
		errs = append(errs, err)
	}
	if err := event.ValidateSourceName(c.SourceName); err != nil {
		errs = append(errs, err)
	}
	if c.WorkerID == "" {
		errs = append(errs, errors.New("worker id is required (EPITAPH_WORKER_ID)"))
	}
	if c.Group != "" {
		errs = append(errs, version.ValidateGroup(c.Group))
	}
	if c.BatchSize < 1 || c.BatchSize > MaxBatchSize {
		errs = append(errs, fmt.Errorf("batch size %d: must be 1..%d", c.BatchSize, MaxBatchSize))
	}
	errs = append(errs, pgdial.CheckTimeout("target TCP timeout", "--target-tcp-timeout", c.TargetTCPTimeout))
	if c.LeaseTTL < 100*time.Millisecond {
		errs = append(errs, fmt.Errorf("lease TTL %s is too short", c.LeaseTTL))
	}
	if c.BalanceInterval <= 0 || c.BalanceInterval >= c.LeaseTTL {
		errs = append(errs, fmt.Errorf("balance interval %s must be positive and below the lease TTL %s", c.BalanceInterval, c.LeaseTTL))
	}
	if c.FetchWait < 10*time.Millisecond || c.FetchWait >= c.LeaseTTL {
		errs = append(errs, fmt.Errorf("fetch wait %s must be at least 10ms and below the lease TTL", c.FetchWait))
	}
	if c.RebuildShare <= 0 || c.RebuildShare > 1 {
		errs = append(errs, fmt.Errorf("rebuild share %g: must be in (0, 1]", c.RebuildShare))
	}
	if c.ReadyMaxPendingAge < 0 {
		errs = append(errs, fmt.Errorf("ready max pending age %s must not be negative", c.ReadyMaxPendingAge))
	}
	if c.MaxRowBytes < 0 {
		errs = append(errs, fmt.Errorf("max row bytes %d must not be negative", c.MaxRowBytes))
	}
	if c.VerifyWindowBytes < 0 {
		errs = append(errs, fmt.Errorf("verify window bytes %d must not be negative", c.VerifyWindowBytes))
	}
	for k, v := range c.ArchiveTTL {
		if k != "*" && !strings.Contains(k, ".") {
			errs = append(errs, fmt.Errorf("archive TTL key %q: use schema.table or *", k))
		}
		if v <= 0 {
			errs = append(errs, fmt.Errorf("archive TTL for %q must be positive", k))
		}
	}
	for _, r := range c.SnapshotRoots {
		if !strings.Contains(r, ".") {
			errs = append(errs, fmt.Errorf("snapshot root %q: use schema.table", r))
		}
	}
	return errors.Join(errs...)
}

// ttlFor is the archive TTL of a table, and false when rows are kept forever.
func (c *Config) ttlFor(qualified string) (time.Duration, bool) {
	if d, ok := c.ArchiveTTL[qualified]; ok {
		return d, true
	}
	d, ok := c.ArchiveTTL["*"]
	return d, ok
}

// ParseTTLs parses "public.sessions=720h,*=8760h" (the EPITAPH_ARCHIVE_TTL
// form); durations also accept a "d" suffix for days.
func ParseTTLs(s string) (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		k, v, ok := strings.Cut(part, "=")
		if !ok {
			return nil, fmt.Errorf("archive TTL %q: want table=duration", part)
		}
		d, err := parseDuration(strings.TrimSpace(v))
		if err != nil {
			return nil, fmt.Errorf("archive TTL %q: %w", part, err)
		}
		out[strings.TrimSpace(k)] = d
	}
	return out, nil
}

func parseDuration(s string) (time.Duration, error) {
	if n, ok := strings.CutSuffix(s, "d"); ok {
		var days int
		if _, err := fmt.Sscanf(n, "%d", &days); err != nil || fmt.Sprint(days) != n {
			return 0, fmt.Errorf("bad day count %q", s)
		}
		return time.Duration(days) * 24 * time.Hour, nil
	}
	return time.ParseDuration(s)
}

// Option configures collaborators of a Service.
type Option func(*options)

type options struct {
	logger   *slog.Logger
	registry *prometheus.Registry
	now      func() time.Time
	// firstBackoff is a partition's first wait after a transient failure
	// (tests lengthen it).
	firstBackoff time.Duration
}

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// WithRegistry sets the registry metrics are registered on (default: a
// private registry, i.e. not exported).
func WithRegistry(r *prometheus.Registry) Option { return func(o *options) { o.registry = r } }

// WithClock sets the clock used for ages in status and metrics.
func WithClock(now func() time.Time) Option { return func(o *options) { o.now = now } }
