package capture

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
)

// Config of a capture service. Zero values take the documented defaults.
type Config struct {
	// SourceURL is the source database (a normal postgres:// URL; the
	// replication connection is derived from it). Required.
	SourceURL string
	// NATSURL of an external JetStream server. Empty runs an embedded
	// server with file storage under DataDir/jetstream, listening on
	// EmbeddedListen.
	NATSURL string
	// NATSAuth authenticates to the external server (NATSURL): a creds
	// file, an nkey seed file, a user with a password file, TLS files.
	// The embedded server needs none of it: it makes its own credentials
	// under DataDir/nats, and the capture connects as its capture role.
	NATSAuth natsconn.Auth
	// EmbeddedListen is host:port of the embedded server; default
	// broker.DefaultListen (127.0.0.1:4222). Port 0 picks a free port.
	EmbeddedListen string
	// DataDir holds the embedded server's storage. Required when embedded.
	DataDir string
	// SourceName names the source in subjects, message ids and the stream
	// name; default "main".
	SourceName string
	// Tables to capture, "schema.table" (a name without a schema is in
	// public). Empty: every ordinary or partitioned table outside
	// Epitaph's own and the system schemas whose deletes can be published
	// safely.
	Tables []string
	// Partitions of the stream; default 8. Fixed when the stream is made:
	// a different value refuses to start.
	Partitions int
	// SlotName and PublicationName default to "epitaph".
	SlotName        string
	PublicationName string
	// SetReplicaIdentityFull runs ALTER TABLE .. REPLICA IDENTITY FULL on
	// every captured table that is not FULL yet (the opt-in that gives
	// whole old rows, and makes tables without a key capturable).
	SetReplicaIdentityFull bool
	// RefuseKeyOnly makes Start fail with a *KeyOnlyError when a selected
	// table is not REPLICA IDENTITY FULL (its deletes would carry only the
	// key), and keeps such tables created while streaming out of the
	// publication. The capture command sets it unless --allow-key-only is
	// given: whole rows are its default. SetReplicaIdentityFull leaves no
	// table key-only.
	RefuseKeyOnly bool
	// RecreateSlot allows continuing after a gap: a missing slot while the
	// stream already holds this source's messages, or an invalidated
	// (wal_status lost) slot, is (re)created and a gap event is published
	// to every partition. A healthy slot is never dropped.
	RecreateSlot bool
	// NoFailoverSlot leaves FAILOVER off the slot. By default, on
	// PostgreSQL 17+, the slot is created (or altered at start) with
	// FAILOVER, so standbys with sync_replication_slots keep a copy that
	// survives their promotion; older servers have no failover slots.
	NoFailoverSlot bool
	// HeartbeatInterval between pg_logical_emit_message heartbeats; default
	// 10s. Negative disables heartbeats, HeartbeatQuiet's too.
	HeartbeatInterval time.Duration
	// HeartbeatQuiet: after a transaction with rows, one heartbeat is
	// emitted once no other such transaction has followed for this long,
	// so every partition's watermark reaches the last commit soon after a
	// burst instead of at the next HeartbeatInterval. Default 250ms;
	// negative: none.
	HeartbeatQuiet time.Duration
	// MaxInFlight bounds the messages in flight (published, not yet proven
	// stored by an acknowledgement); default 4096.
	MaxInFlight int
	// Replicas of the stream when it is created; default 1.
	Replicas int
	// Retention is the stream's MaxAge; 0 keeps messages forever.
	// RetentionMaxBytes, RetentionMaxMsgs and RetentionMaxMsgsPerSubject
	// are the stream's other discarding limits; 0 is none. These are the
	// only limits the capture accepts on its stream (limits.go): another
	// limit that would discard events makes it refuse to start, and one
	// changed while it streams is restored.
	Retention                  time.Duration
	RetentionMaxBytes          int64
	RetentionMaxMsgs           int64
	RetentionMaxMsgsPerSubject int64
	// StreamCheckInterval is how often the stream's limits are checked
	// while streaming; default 10s; negative: only at start.
	StreamCheckInterval time.Duration
	// DuplicateWindow of the stream's Msg-Id dedupe; default
	// DefaultDuplicateWindow. No guarantee rests on it (see
	// DefaultDuplicateWindow); it costs the server memory and CPU per
	// message id it holds.
	DuplicateWindow time.Duration
	// BrokerSyncInterval is how long the confirmed LSN trails the
	// acknowledgements of a 1-replica stream (the broker acknowledges before
	// it fsyncs). Default: the embedded server's sync interval (10s), or 2m
	// (the nats-server default) for an external server. Negative: do not
	// trail (use it when the server runs with sync_always).
	BrokerSyncInterval time.Duration
	// StreamPersist is the persist mode of the stream when it is created:
	// "async" (JetStream acknowledges a message once it is in the server's
	// write buffer, and writes buffered messages a few milliseconds later)
	// or "default" (the server writes every message to its file before it
	// acknowledges). Empty ("auto"): async for the embedded server with one
	// replica and a trailing confirmation, default otherwise. Async is safe
	// only because confirmations trail the acknowledgements (a killed server
	// loses at most its unwritten buffer, which the source sends again) and
	// projectors detect a lost tail; it needs BrokerSyncInterval > 0 and one
	// replica. An existing stream keeps the mode it was made with.
	StreamPersist string
	// MetricsAddr serves /metrics, /healthz and /status; empty: no server.
	MetricsAddr string
	// Standby makes several captures of one slot safe: each takes a lease
	// (a session advisory lock on the source keyed by database and slot
	// name, on a dedicated connection) before it touches the publication
	// or the slot, and waits for it otherwise (see the package doc, "Standby").
	// Needs an external JetStream server (NATSURL).
	Standby bool
	// StandbyPoll is how often a standby tries to take the lease, and how
	// often the holder checks it still has it; default 1s.
	StandbyPoll time.Duration
	// SigningKey is the Ed25519 key file the capture signs its commits,
	// marks, heartbeats and gaps with (PEM PKCS#8 or a raw 32-byte seed,
	// mode 0600). Empty: DataDir/signing.key, generated on first start.
	// The public key is written beside it (signing.pub) and logged.
	SigningKey string
	// SourceTCPTimeout bounds how long what the capture sends to the
	// source (a standby status update, a query, a keepalive probe) may
	// stay unacknowledged before the connection is given up: every source
	// connection is dialled with TCP_USER_TIMEOUT set to it and TCP
	// keepalive probes every half of it, at most 15 s (Linux; other
	// systems keep their own behaviour). A network path that dies without
	// a FIN or RST (a NAT or firewall forgetting the flow, a failover
	// moving the address) then fails the connection about this long after
	// the capture next sends on it, or last heard from the server while it
	// waits for an answer, and the capture reconnects, instead of waiting
	// for TCP to give up after about 15 minutes. Default
	// DefaultSourceTCPTimeout; negative: the system's default. At least
	// 1s, at most 24h.
	SourceTCPTimeout time.Duration
	// ApplicationName is set on every connection to the source, so
	// operators see who holds the slot and the lease in pg_stat_activity;
	// default "epitaph-capture:<hostname>-<pid>".
	ApplicationName string

	// Following the source's schema while streaming.

	// CatalogPoll is how often the capture checks the catalog while it
	// streams (and it checks after every Relation message too): a new table
	// or partition that fits Tables (or, when Tables is empty, any table
	// whose deletes can be published safely) is added to the publication; a
	// published table that loses its usable replica identity is removed
	// (and a gap recorded) so the application's DELETEs never fail, and
	// added again once it is safe. Default 5s; negative: never (the
	// publication is synced at start only).
	CatalogPoll time.Duration
	// InstallDDLGuard installs an event trigger on the source (it needs a
	// superuser) that runs at the end of the DDL commands that can change
	// what the publication may hold; DDLGuardMode says what it does there.
	InstallDDLGuard bool
	// DDLGuardMode is the DDL guard's mode: DDLGuardNotify (the default)
	// signals the capture, which checks the catalog at once, outside the
	// application's transaction; DDLGuardInline applies the publication
	// rules inside the DDL's transaction, so no DELETE can fail inside the
	// poll window and a new table is published from the CREATE TABLE on.
	DDLGuardMode string

	// Sharing the source's CPUs (cpumode.go).

	// TailCPUs caps the process's GOMAXPROCS while the capture is tailing
	// (fewer than CatchUpBytes of WAL behind the source), so a capture on
	// the source's machine keeps off the cores of its backends while it
	// merely follows them; with a backlog it uses every CPU the process
	// had at start. 0 (the library's default): never capped. It sets the
	// process's GOMAXPROCS: one capture per process (the capture binary).
	TailCPUs int
	// CatchUpBytes is how far behind the source's WAL end (WAL bytes) a
	// tailing capture falls before it uses every CPU; it tails again once
	// it is within min(1 MiB, CatchUpBytes/4), and a capture that starts
	// further behind than that catches up first. Default
	// DefaultCatchUpBytes; at least 1 MiB.
	CatchUpBytes int64
	// TailNice is the nice value (1-19; 0, the library's default: none)
	// of the process's scheduling group while it tails within a quarter
	// of CatchUpBytes of the source (a burst of deletes goes first), 0
	// further behind (it tails again at nice TailNice within a sixteenth)
	// and while it catches up: Linux shares the CPUs between sessions' autogroups
	// first, so this, not a thread's nice, lets the source's backends go
	// first on shared cores. Set where the capture leads its own session
	// in the root CPU cgroup (cpunice_linux.go; elsewhere Status says why
	// not). Needs TailCPUs > 0. It sets the process's autogroup: one
	// capture per process.
	TailNice int

	// digestV1 makes the capture write digest v1, as one before digest v2
	// did (tests of an upgrade).
	digestV1 bool
}

// Defaults of the Config fields left zero, which the capture command's
// flags show.
const (
	DefaultSourceName          = "main"
	DefaultPartitions          = 8
	DefaultSlotName            = "epitaph"
	DefaultPublicationName     = "epitaph"
	DefaultStreamCheckInterval = 10 * time.Second
	DefaultHeartbeatInterval   = 10 * time.Second
	DefaultHeartbeatQuiet      = 250 * time.Millisecond
	DefaultMaxInFlight         = 4096
	DefaultCatalogPoll         = 5 * time.Second
	DefaultStandbyPoll         = time.Second
	DefaultSourceTCPTimeout    = 30 * time.Second
)

// minHeartbeatQuiet is the shortest Config.HeartbeatQuiet: shorter would
// emit a heartbeat between the transactions of an ordinary busy source.
const minHeartbeatQuiet = 50 * time.Millisecond

// EmbeddedSyncInterval is the file store sync interval of the embedded
// JetStream server the capture runs itself.
const EmbeddedSyncInterval = 10 * time.Second

// externalSyncInterval is nats-server's default sync interval.
const externalSyncInterval = 2 * time.Minute

// DefaultDuplicateWindow is the stream's dedupe window unless
// --duplicate-window says otherwise: JetStream's minimum. It is short on
// purpose: the server keeps every message id of the window in
// memory (~136 bytes each: at 150,000 rows/s a 2m window held 1.2M ids,
// ~136 MB and a quarter of the server's CPU in garbage collection), and up
// to three windows' worth until it compacts its list of them, so what it
// holds grows with the rate: with the embedded broker at 82,000 rows/s a
// 1 s window kept 40-50 MB of ids live and the capture's process peaked at
// 191.5 MiB, 100ms kept ~7 MB and it peaked at 87.6 MiB (the one-million-
// row transaction, same machine and rate). Nothing rests on the window:
//
//   - Within a session every message expects the previous one as the
//     stream's last (Nats-Expected-Last-Msg-Id: JetStream keeps the last id
//     whatever the window) and nothing is retried, so what a session
//     stored is a prefix of what it sent; a new session resumes after the
//     last message the stream proves with its signature, skipping by
//     position what is at or before it and adopting what is after it
//     (trust.go). No re-send is left for the window to drop.
//   - A session's first messages are published one at a time; one that
//     JetStream does answer as a duplicate is published again under
//     event.RepublishedMsgID, so even inside the window a copy is stored.
//   - No other writer can hold one of the capture's ids: each carries a
//     tag keyed by the signing key (event.MsgIDTagger). A forgery under
//     the plain id, inside the window or past it, stays beside the real
//     message, which is stored under its own id, and projectors believe
//     only signed messages (capture/TestForgedIDsInsideTheWindowNeverTakeTheRealOnes,
//     TestForgedIDsOutsideTheWindowStayBesideTheRealOnes).
const DefaultDuplicateWindow = minDuplicateWindow

// minDuplicateWindow is the shortest window JetStream accepts.
const minDuplicateWindow = 100 * time.Millisecond

// Option sets a collaborator of the service.
type Option func(*Service)

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(s *Service) { s.log = l } }

// WithRegistry sets the Prometheus registry the metrics are registered on
// (default: a private registry, served on MetricsAddr).
func WithRegistry(r *prometheus.Registry) Option { return func(s *Service) { s.reg = r } }

func (c *Config) setDefaults() {
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{
		{&c.StreamCheckInterval, DefaultStreamCheckInterval}, {&c.HeartbeatInterval, DefaultHeartbeatInterval},
		{&c.HeartbeatQuiet, DefaultHeartbeatQuiet}, {&c.DuplicateWindow, DefaultDuplicateWindow},
		{&c.CatalogPoll, DefaultCatalogPoll}, {&c.StandbyPoll, DefaultStandbyPoll}, {&c.SourceTCPTimeout, DefaultSourceTCPTimeout},
	} {
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if c.SourceName == "" {
		c.SourceName = DefaultSourceName
	}
	if c.Partitions == 0 {
		c.Partitions = DefaultPartitions
	}
	if c.SlotName == "" {
		c.SlotName = DefaultSlotName
	}
	if c.PublicationName == "" {
		c.PublicationName = DefaultPublicationName
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.DDLGuardMode == "" {
		c.DDLGuardMode = DDLGuardNotify
	}
	if c.NATSURL == "" && c.EmbeddedListen == "" {
		c.EmbeddedListen = broker.DefaultListen
	}
	if c.CatchUpBytes == 0 {
		c.CatchUpBytes = DefaultCatchUpBytes
	}
	if c.ApplicationName == "" {
		c.ApplicationName = defaultApplicationName()
	}
	if c.BrokerSyncInterval == 0 {
		if c.NATSURL == "" {
			c.BrokerSyncInterval = EmbeddedSyncInterval
		} else {
			c.BrokerSyncInterval = externalSyncInterval
		}
	}
	if c.StreamPersist == "" || c.StreamPersist == PersistAuto {
		c.StreamPersist = PersistDefault
		if c.NATSURL == "" && c.Replicas == 1 && c.BrokerSyncInterval > 0 {
			c.StreamPersist = PersistAsync
		}
	}
}

// Stream persist modes (Config.StreamPersist).
const (
	PersistAuto    = "auto"
	PersistAsync   = "async"
	PersistDefault = "default"
)

// DDL guard modes (Config.DDLGuardMode).
const (
	// DDLGuardNotify: the guard only signals the capture (NOTIFY on the
	// publication's channel), which publishes a new table milliseconds after
	// its creating transaction commits.
	DDLGuardNotify = "notify"
	// DDLGuardInline: the guard applies the publication rules inside the
	// DDL's transaction.
	DDLGuardInline = "inline"
)

// validate lists every problem of the configuration in one ConfigError.
func (c *Config) validate() error {
	errs := c.connectionErrors(nil)
	errs = c.nameErrors(errs)
	errs = c.streamErrors(errs)
	if c.HeartbeatQuiet > 0 && c.HeartbeatQuiet < minHeartbeatQuiet {
		errs = append(errs, fmt.Sprintf("heartbeat quiet time must be at least %s (negative: none), got %s", minHeartbeatQuiet, c.HeartbeatQuiet))
	}
	if len(errs) > 0 {
		return &ConfigError{Msg: strings.Join(errs, "; ")}
	}
	return nil
}

// connectionErrors appends the problems of the source URL, the data
// directory and the JetStream connection to errs.
func (c *Config) connectionErrors(errs []string) []string {
	if c.SourceURL == "" {
		errs = append(errs, "a source database URL is required (EPITAPH_SOURCE_URL)")
	} else if u, err := url.Parse(c.SourceURL); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		if !strings.Contains(c.SourceURL, "=") { // keyword/value DSNs are accepted as they are
			errs = append(errs, "the source URL must be postgres://user@host:port/db")
		}
	}
	if c.NATSURL == "" && c.DataDir == "" {
		errs = append(errs, "a data directory is required for the embedded JetStream server (EPITAPH_DATA_DIR)")
	} else if c.DataDir == "" && c.SigningKey == "" {
		errs = append(errs, "a data directory (EPITAPH_DATA_DIR) or a signing key file (EPITAPH_SIGNING_KEY) is required: the capture signs what it publishes")
	}
	if err := pgdial.CheckTimeout("source TCP timeout", "--source-tcp-timeout", c.SourceTCPTimeout); err != nil {
		errs = append(errs, err.Error())
	}
	// NATS authentication.
	if c.NATSURL == "" && !c.NATSAuth.IsZero() {
		errs = append(errs, "--nats-creds, --nats-nkey, --nats-user and --nats-tls-* are for an external JetStream server (EPITAPH_NATS_URL): the embedded one makes its own credentials under <data-dir>/nats")
	} else if err := c.NATSAuth.Validate(c.NATSURL); err != nil {
		errs = append(errs, err.Error())
	}
	return errs
}

// nameErrors appends the problems of the source, slot, publication and
// table names and of the partition count to errs.
func (c *Config) nameErrors(errs []string) []string {
	if err := event.ValidateSourceName(c.SourceName); err != nil {
		errs = append(errs, err.Error())
	}
	if c.Partitions < 1 || c.Partitions > 1024 {
		errs = append(errs, fmt.Sprintf("partitions must be 1..1024, got %d", c.Partitions))
	}
	if !identRE.MatchString(c.SlotName) {
		errs = append(errs, fmt.Sprintf("slot name %q: use lower-case letters, digits and '_' (at most 63)", c.SlotName))
	}
	if c.PublicationName == "" || len(c.PublicationName) > 63 {
		errs = append(errs, fmt.Sprintf("publication name %q: 1 to 63 bytes", c.PublicationName))
	}
	for _, t := range c.Tables {
		if _, _, err := splitTable(t); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if c.DDLGuardMode != DDLGuardNotify && c.DDLGuardMode != DDLGuardInline {
		errs = append(errs, fmt.Sprintf("DDL guard mode %q: use %s or %s", c.DDLGuardMode, DDLGuardNotify, DDLGuardInline))
	}
	return errs
}

// streamErrors appends the problems of the publishing, stream and standby
// settings to errs.
func (c *Config) streamErrors(errs []string) []string {
	if c.MaxInFlight < 1 {
		errs = append(errs, fmt.Sprintf("max in-flight publishes must be positive, got %d", c.MaxInFlight))
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		errs = append(errs, fmt.Sprintf("stream replicas must be 1..5, got %d", c.Replicas))
	}
	if c.Retention < 0 || c.RetentionMaxBytes < 0 || c.RetentionMaxMsgs < 0 || c.RetentionMaxMsgsPerSubject < 0 {
		errs = append(errs, "retention limits must not be negative")
	}
	if c.DuplicateWindow < 0 {
		errs = append(errs, "duplicate window must not be negative")
	}
	if c.DuplicateWindow > 0 && c.DuplicateWindow < minDuplicateWindow {
		errs = append(errs, fmt.Sprintf("duplicate window must be at least %v (JetStream's minimum), got %v", minDuplicateWindow, c.DuplicateWindow))
	}
	if c.Retention > 0 && c.DuplicateWindow > c.Retention {
		errs = append(errs, "duplicate window must not exceed retention")
	}
	switch c.StreamPersist {
	case PersistDefault:
	case PersistAsync:
		if c.Replicas > 1 {
			errs = append(errs, "stream persist mode async needs a 1-replica stream (JetStream refuses it on replicated streams): use --stream-persist default")
		}
		if c.BrokerSyncInterval < 0 {
			errs = append(errs, "stream persist mode async needs confirmations that trail the broker (a positive --broker-sync-interval): a killed server loses its unwritten buffer, which only a trailing confirmation sends again")
		}
	default:
		errs = append(errs, fmt.Sprintf("stream persist mode %q: use auto, async or default", c.StreamPersist))
	}
	if c.Standby && c.NATSURL == "" {
		errs = append(errs, "standby needs an external JetStream server (EPITAPH_NATS_URL): with the embedded broker every capture would have a stream of its own")
	}
	if c.StandbyPoll < 0 {
		errs = append(errs, "standby poll interval must be positive")
	}
	if c.TailCPUs < 0 {
		errs = append(errs, fmt.Sprintf("tail CPUs %d: use 0 (every CPU) or more", c.TailCPUs))
	}
	if c.TailNice < 0 || c.TailNice > 19 {
		errs = append(errs, fmt.Sprintf("tail nice %d: use 0 (none) to 19", c.TailNice))
	}
	if c.CatchUpBytes < minCatchUpBytes {
		errs = append(errs, fmt.Sprintf("catch-up bytes %d: at least %d (1 MiB)", c.CatchUpBytes, minCatchUpBytes))
	}
	return errs
}

// defaultApplicationName names this process: "epitaph-capture:<host>-<pid>"
// (PostgreSQL keeps the first 63 bytes).
func defaultApplicationName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return "epitaph-capture:" + host + "-" + strconv.Itoa(os.Getpid())
}

// embeddedStoreDir is where the embedded server keeps its files.
func (c *Config) embeddedStoreDir() string { return filepath.Join(c.DataDir, "jetstream") }

// EmbeddedCredsDir is where the embedded server of a capture with dataDir
// keeps its keys and the roles' credentials (capture.creds,
// projector.creds).
func EmbeddedCredsDir(dataDir string) string { return filepath.Join(dataDir, "nats") }

// ConfigError is a configuration or environment problem the operator must
// fix; retrying without a change gives the same error.
type ConfigError struct{ Msg string }

func (e *ConfigError) Error() string { return e.Msg }

// KeyOnlyError is the refusal of RefuseKeyOnly: Tables ("schema.table")
// are not REPLICA IDENTITY FULL. It is a *ConfigError too (errors.As).
type KeyOnlyError struct{ Tables []string }

func (e *KeyOnlyError) Error() string {
	return fmt.Sprintf("tables without REPLICA IDENTITY FULL, whose deletes would archive only the key: %s. "+
		"Start with --set-replica-identity-full to make them FULL (capture uninstall puts them back), "+
		"or with --allow-key-only to archive their keys only", strings.Join(e.Tables, ", "))
}

func (e *KeyOnlyError) Unwrap() error { return &ConfigError{Msg: e.Error()} }

// IsPermanent reports whether err is a *ConfigError (fix, then restart)
// rather than a transient failure (restart and it may pass).
func IsPermanent(err error) bool {
	var ce *ConfigError
	return errors.As(err, &ce)
}

func configErr(format string, args ...any) error {
	return &ConfigError{Msg: fmt.Sprintf(format, args...)}
}

// splitTable parses "schema.table" (or "table", in public). Quoted parts
// ("My Schema"."My.Table") keep their case and dots.
func splitTable(s string) (schema, table string, err error) {
	parts, err := splitQualified(strings.TrimSpace(s))
	if err != nil {
		return "", "", fmt.Errorf("table %q: %w", s, err)
	}
	switch len(parts) {
	case 1:
		return "public", parts[0], nil
	case 2:
		return parts[0], parts[1], nil
	default:
		return "", "", fmt.Errorf("table %q: use schema.table", s)
	}
}

func splitQualified(s string) ([]string, error) {
	var parts []string
	for len(s) > 0 {
		var part string
		if s[0] == '"' {
			var b strings.Builder
			i := 1
			for {
				if i >= len(s) {
					return nil, errors.New("unterminated quote")
				}
				if s[i] == '"' {
					if i+1 < len(s) && s[i+1] == '"' {
						b.WriteByte('"')
						i += 2
						continue
					}
					i++
					break
				}
				b.WriteByte(s[i])
				i++
			}
			part, s = b.String(), s[i:]
		} else {
			j := strings.IndexByte(s, '.')
			if j < 0 {
				j = len(s)
			}
			part, s = strings.ToLower(s[:j]), s[j:]
		}
		if part == "" {
			return nil, errors.New("empty name")
		}
		parts = append(parts, part)
		if len(s) > 0 {
			if s[0] != '.' || len(s) == 1 {
				return nil, errors.New("use schema.table")
			}
			s = s[1:]
		}
	}
	if len(parts) == 0 {
		return nil, errors.New("empty name")
	}
	return parts, nil
}
