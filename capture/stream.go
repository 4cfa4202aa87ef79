package capture

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// HeaderPosition is set on every message the capture publishes; see
// event.HeaderPosition. On restart every re-sent message at or before the
// resume position is skipped.
const HeaderPosition = event.HeaderPosition

// Stream metadata keys (wire contract: see event).
const (
	MetaPartitions  = event.MetaPartitions
	MetaSource      = event.MetaSource
	MetaWireVersion = event.MetaWireVersion
)

// position orders the capture's output: Epitaph-Position is
// "<trigger lsn>#<n>", strictly increasing in output order. The trigger of
// a transaction's messages is its commit LSN; of a non-transactional
// message or a gap, the LSN just before the end of its record (endTrigger).
type position struct {
	lsn event.LSN
	n   int
}

func (p position) String() string { return p.lsn.String() + "#" + strconv.Itoa(p.n) }

func (p position) after(q position) bool {
	return p.lsn > q.lsn || (p.lsn == q.lsn && p.n > q.n)
}

func parsePosition(s string) (position, error) {
	l, n, ok := strings.Cut(s, "#")
	if !ok {
		return position{}, fmt.Errorf("position %q: missing '#'", s)
	}
	lsn, err := event.ParseLSN(l)
	if err != nil {
		return position{}, fmt.Errorf("position %q: %w", s, err)
	}
	i, err := strconv.Atoi(n)
	if err != nil || i < 0 {
		return position{}, fmt.Errorf("position %q: bad index", s)
	}
	return position{lsn: lsn, n: i}, nil
}

// tail is what the stream proves the capture published (see findResume).
type tail struct {
	has bool
	pos position
	// recorded: the highest position the capture recorded, before
	// confirming it, as confirmed to its slot (0: no record).
	recorded event.LSN
	// timeline: the source's timeline recorded with it (0: none).
	timeline int32
}

// openStream opens the source's stream and checks it was made for this
// configuration (see checkStream); it returns nil, nil when the stream does
// not exist yet.
//
// enforce, when set, checks and corrects the stream's limits
// (Service.enforceLimits); nil leaves them alone.
func openStream(ctx context.Context, js jetstream.JetStream, cfg *Config, enforce limitsEnforcer) (jetstream.Stream, error) {
	name := event.StreamName(cfg.SourceName)
	st, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open stream %s: %w", name, err)
	}
	return st, checkStream(ctx, js, st, cfg, enforce)
}

// ensureStream creates the source's stream if missing, or checks an
// existing one as openStream does.
func ensureStream(ctx context.Context, js jetstream.JetStream, cfg *Config, enforce limitsEnforcer) (jetstream.Stream, error) {
	if st, err := openStream(ctx, js, cfg, enforce); st != nil || err != nil {
		return st, err
	}
	name := event.StreamName(cfg.SourceName)
	sc := jetstream.StreamConfig{
		Name:        name,
		Description: "Epitaph: deletes captured from source " + cfg.SourceName,
		Subjects:    []string{event.StreamSubjects(cfg.SourceName)},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardOld,
		Replicas:    cfg.Replicas,
		Duplicates:  cfg.DuplicateWindow,
		PersistMode: persistMode(cfg.StreamPersist),
		// No purge, no roll-up: only single messages can be removed
		// (erase --purge-stream), each a hole the readers see.
		DenyPurge: true,
		Metadata: map[string]string{
			MetaPartitions:  strconv.Itoa(cfg.Partitions),
			MetaSource:      cfg.SourceName,
			MetaWireVersion: strconv.Itoa(event.Version),
		},
	}
	applyLimits(&sc, cfg.limits())
	st, err := js.CreateStream(ctx, sc)
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Made by someone else meanwhile: check theirs.
		if st, err = openStream(ctx, js, cfg, enforce); st == nil && err == nil {
			err = fmt.Errorf("stream %s was created and deleted while capture started", name)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("create stream %s: %w", name, err)
	}
	return st, nil
}

// limitsEnforcer checks and corrects a stream's limits at start.
type limitsEnforcer func(ctx context.Context, js jetstream.JetStream, sc jetstream.StreamConfig) error

// checkStream checks that an existing stream was made by Epitaph for this
// source and partition count, and is replicated if the capture confirms as
// for a replicated one; brings its dedupe window to the configured one,
// and has enforce check its limits.
func checkStream(ctx context.Context, js jetstream.JetStream, st jetstream.Stream, cfg *Config, enforce limitsEnforcer) error {
	name := event.StreamName(cfg.SourceName)
	info, err := st.Info(ctx)
	if err != nil {
		return fmt.Errorf("read stream %s: %w", name, err)
	}
	p := info.Config.Metadata[MetaPartitions]
	if p == "" {
		return configErr("stream %s has no %s metadata: it was not made by Epitaph; use another --source-name or delete the stream", name, MetaPartitions)
	}
	if p != strconv.Itoa(cfg.Partitions) {
		return configErr("stream %s was made with %s partitions, capture is configured with %d: start with EPITAPH_PARTITIONS=%s (the partition count of a stream never changes)", name, p, cfg.Partitions, p)
	}
	if src := info.Config.Metadata[MetaSource]; src != "" && src != cfg.SourceName {
		return configErr("stream %s belongs to source %q, not %q", name, src, cfg.SourceName)
	}
	if info.Config.PersistMode == jetstream.AsyncPersistMode && cfg.BrokerSyncInterval < 0 {
		return configErr("stream %s was made with persist mode async: its server may lose acknowledged messages it has not written yet, so confirmations must trail it (a positive --broker-sync-interval)", name)
	}
	if info.Config.Replicas == 1 && cfg.Replicas > 1 && cfg.BrokerSyncInterval < 0 {
		return configErr("stream %s was made with 1 replica, capture is configured with %d and confirms without trailing the broker (--broker-sync-interval -1): a power loss of its one server may lose acknowledged messages the slot no longer holds; raise the stream's replicas (nats stream edit %s --replicas %d) or give a positive --broker-sync-interval", name, cfg.Replicas, name, cfg.Replicas)
	}
	sc := info.Config
	if cfg.DuplicateWindow != sc.Duplicates {
		sc.Duplicates = cfg.DuplicateWindow
		updated, err := js.UpdateStream(ctx, sc)
		if err != nil {
			return fmt.Errorf("update stream %s dedupe window: %w", name, err)
		}
		sc = updated.CachedInfo().Config
	}
	if enforce != nil {
		return enforce(ctx, js, sc)
	}
	return nil
}

// leaderWatch says, while a publish is unanswered, why the broker cannot
// answer it now: the stream's leader is another than the one the session
// started with (a leader that steps down, or whose node stops, drops the
// publishes it had not stored without answering them), or the stream has
// no leader, does not answer, or its leader has lost touch with its quorum
// (a cluster with two of three nodes down). The capture reports the broker
// unavailable meanwhile instead of healthy, until the acknowledgement or
// its timeout (a minute); another leader (errLeaderChanged), once its
// quorum has held for longer than quorumSilence, ends the session.
func leaderWatch(stream jetstream.Stream) func() error {
	var leader string
	if ci := stream.CachedInfo(); ci != nil && ci.Cluster != nil {
		leader = ci.Cluster.Leader
	}
	changed := 0 // consecutive checks that found another leader with a quorum
	return func() error {
		now, err := checkLeader(stream, &leader)
		if now == "" {
			changed = 0
			return err
		}
		// The session's publishes may have gone to this leader (a
		// step-down while nothing was in flight) just before it lost its
		// quorum: a replica stopped a moment ago still counts as heard
		// from. Only a quorum that holds for longer than quorumSilence
		// proves the publishes went to the old leader, which dropped them.
		if changed++; changed < leaderChangedChecks {
			return fmt.Errorf("%w (now %s, was %s)", errLeaderMoved, now, leader)
		}
		return fmt.Errorf("%w (now %s, was %s)", errLeaderChanged, now, leader)
	}
}

// leaderChangedChecks is how many checks in a row (stalledCheck apart)
// must find another leader with a quorum before the session ends: they
// span more than quorumSilence.
const leaderChangedChecks = int(quorumSilence/stalledCheck) + 2

// checkLeader is one check of leaderWatch (leader: the session's, set at
// the first check when unknown): an errLeaderMoved, or now, another leader
// than the session's, with a quorum.
func checkLeader(stream jetstream.Stream, leader *string) (now string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), stalledCheck)
	defer cancel()
	info, err := stream.Info(ctx)
	if err != nil {
		if to, ok := outage(err); ok && to == linkBroker {
			// No leader (a cluster without its quorum) or no answer.
			return "", fmt.Errorf("%w: %v", errLeaderMoved, err)
		}
		return "", nil // cannot tell: the acknowledgement's timeout decides
	}
	if info.Cluster == nil {
		return "", nil // not told: the acknowledgement's timeout decides
	}
	if info.Cluster.Leader == "" {
		return "", fmt.Errorf("%w: the stream has no leader", errLeaderMoved)
	}
	// A leader that lost touch with its quorum goes on calling itself
	// the leader for a while, storing nothing; what was sent to it may
	// still be stored once the quorum is back, so even another leader
	// than the session's is waited for then.
	live := 1
	for _, r := range info.Cluster.Replicas {
		if !r.Offline && r.Active < quorumSilence {
			live++
		}
	}
	if n := len(info.Cluster.Replicas) + 1; live < n/2+1 {
		return "", fmt.Errorf("%w: leader %s hears from %d of its %d replicas, short of a quorum", errLeaderMoved, info.Cluster.Leader, live-1, n-1)
	}
	if *leader == "" {
		*leader = info.Cluster.Leader
		return "", nil
	}
	if info.Cluster.Leader != *leader {
		return info.Cluster.Leader, nil
	}
	return "", nil
}

// settle returns once the stream's leader holds no publish it has not
// stored yet, so that what the stream then says it holds is all it will
// ever hold of what was sent before (findResume reads it next).
//
// A stream's leader answers what the stream holds (its info, its last
// messages) from what it has stored. A leader that lost its quorum goes on
// taking publishes for a while (the previous session's, or a killed
// process's) and stores them once a quorum answers it again, possibly
// after the new session read where the stream ends: the session would
// publish them again (its first message expects no last id, and the
// dedupe window is far shorter than an outage), and the stream would hold
// them twice. A new leader is no such risk: it takes nothing before it has
// stored what its predecessors left in its log.
//
// The leader counts the publishes it has taken (stored or not), and checks
// a publish's Nats-Expected-Last-Sequence against that count before it
// takes it. So settle reads the stream's last sequence, then sends a probe
// expecting it, which the leader always refuses, never storing it: "wrong
// last sequence" while it has taken more than it stored, or, once it holds
// nothing unstored, the probe's other, invalid header (an expected
// subject without its sequence). A single server, which stores what it
// takes at once, answers the latter at once. The probe goes on the
// connection the earlier publishes went on, to the stream's subjects, so
// the leader counts those first. A stream whose leader holds publishes for
// longer than settleTimeout (no quorum) ends the session start as an
// outage of the broker, retried.
func settle(ctx context.Context, js jetstream.JetStream, stream jetstream.Stream, src string) (stored bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	subject := event.SettleSubject(src)
	for {
		info, ierr := stream.Info(ctx)
		if ierr != nil {
			return false, fmt.Errorf("wait for stream %s to store what its leader holds: %w", event.StreamName(src), brokerIO(ierr))
		}
		m := nats.NewMsg(subject)
		m.Header.Set(jetstream.ExpectedLastSeqHeader, strconv.FormatUint(info.State.LastSeq, 10))
		m.Header.Set(expectedLastSubjectSeqSubject, subject)
		_, err = js.PublishMsg(ctx, m, noRetries)
		var apiErr *jetstream.APIError
		switch {
		case errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeExpectedLastSubjectSeqMissing:
			return false, nil
		case errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeWrongLastSeq:
			// Taken but not stored yet (or stored between the two
			// requests): ask again.
			select {
			case <-ctx.Done():
				return false, fmt.Errorf("wait for stream %s to store what its leader holds: %w", event.StreamName(src), ctx.Err())
			case <-time.After(settlePoll):
			}
		case err != nil:
			return false, fmt.Errorf("wait for stream %s to store what its leader holds: %w", event.StreamName(src), brokerIO(err))
		default:
			// A server older than 2.12, which does not refuse the
			// invalid header, stored the probe (outside every partition:
			// no projector reads it, the resume skips it) after
			// everything it had taken.
			return true, nil
		}
	}
}

// expectedLastSubjectSeqSubject is JetStream's
// Nats-Expected-Last-Subject-Sequence-Subject header: the subject a
// Nats-Expected-Last-Subject-Sequence is checked on.
const expectedLastSubjectSeqSubject = "Nats-Expected-Last-Subject-Sequence-Subject"

// settleStoredWarning is logged once when the server stored a settle probe.
const settleStoredWarning = "the NATS server stored the capture's settle probe (a server older than 2.12 does not refuse it): one empty message on the settle subject per session start, which no projector reads and the capture skips; upgrade the server to stop them"

// JetStream's refusals of settle's probe.
const (
	jsErrCodeWrongLastSeq                  jetstream.ErrorCode = 10071 // wrong last sequence: {seq}
	jsErrCodeExpectedLastSubjectSeqMissing jetstream.ErrorCode = 10193 // missing sequence for expected last sequence per subject
)

// settleTimeout bounds settle; settlePoll is how often it asks again.
const (
	settleTimeout = 30 * time.Second
	settlePoll    = 100 * time.Millisecond
)

// quorumSilence is how long a stream's leader may not have heard from a
// replica before leaderWatch counts the replica lost (a busy or idle
// replica is heard from every second at least).
const quorumSilence = 5 * time.Second

func persistMode(s string) jetstream.PersistModeType {
	if s == PersistAsync {
		return jetstream.AsyncPersistMode
	}
	return jetstream.DefaultPersistMode
}

func ensureRowBucket(ctx context.Context, js jetstream.JetStream, cfg *Config) (jetstream.ObjectStore, error) {
	name := event.RowBucket(cfg.SourceName)
	obs, err := js.ObjectStore(ctx, name)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		obs, err = js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{
			Bucket:      name,
			Description: "Epitaph: rows of source " + cfg.SourceName + " larger than the broker's payload limit",
			Storage:     jetstream.FileStorage,
			Replicas:    cfg.Replicas,
			TTL:         cfg.Retention,
		})
		if errors.Is(err, jetstream.ErrBucketExists) {
			obs, err = js.ObjectStore(ctx, name)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("open object store %s: %w", name, err)
	}
	return obs, nil
}

// connectNATS connects with no reconnect buffer: while disconnected every
// publish fails at once instead of being buffered and sent later, so the
// stream always holds a prefix of what the capture published.
func connectNATS(url, name string, extra ...nats.Option) (*nats.Conn, error) {
	opts := append([]nats.Option{
		nats.Name(name),
		nats.ReconnectBufSize(-1),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
	}, extra...)
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", RedactURL(url), err)
	}
	return nc, nil
}
