package capture

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// Limits are the stream limits that discard stored messages (max-age
// always; the others with DiscardOld, the capture's policy): a message
// removed before every
// projector version applied it is lost to the archive. The capture sets
// exactly the limits --retention asks for (none by default: rebuilds need
// the whole history) and keeps them so. Zero means no limit.
type Limits struct {
	MaxAge            time.Duration
	MaxBytes          int64
	MaxMsgs           int64
	MaxMsgsPerSubject int64
}

// limit names, as in --retention and in messages.
const (
	limitMaxAge     = "max-age"
	limitMaxBytes   = "max-bytes"
	limitMaxMsgs    = "max-msgs"
	limitPerSubject = "max-msgs-per-subject"
)

var limitNames = []string{limitMaxAge, limitMaxBytes, limitMaxMsgs, limitPerSubject}

// ParseRetention reads --retention: empty or "0" (no limit: keep every
// message), a duration ("720h": max-age), or comma-separated name=value
// pairs of max-age (a duration), max-bytes (bytes, with an optional K, M,
// G or T suffix, powers of 1024), max-msgs and max-msgs-per-subject
// (counts), e.g. "max-age=720h,max-bytes=50G".
func ParseRetention(s string) (Limits, error) {
	var l Limits
	s = strings.TrimSpace(s)
	if s == "" || s == "0" {
		return l, nil
	}
	if !strings.Contains(s, "=") {
		d, err := time.ParseDuration(s)
		if err != nil || d < 0 {
			return l, fmt.Errorf("retention %q: want a duration such as 720h, or name=value pairs of %s", s, strings.Join(limitNames, ", "))
		}
		l.MaxAge = d
		return l, nil
	}
	for _, part := range strings.Split(s, ",") {
		name, value, ok := strings.Cut(strings.TrimSpace(part), "=")
		name, value = strings.TrimSpace(name), strings.TrimSpace(value)
		if !ok || value == "" {
			return l, fmt.Errorf("retention %q: %q is not name=value", s, part)
		}
		var err error
		switch name {
		case limitMaxAge:
			l.MaxAge, err = time.ParseDuration(value)
			if err == nil && l.MaxAge < 0 {
				err = errors.New("negative")
			}
		case limitMaxBytes:
			l.MaxBytes, err = parseBytes(value)
		case limitMaxMsgs:
			l.MaxMsgs, err = parseCount(value)
		case limitPerSubject:
			l.MaxMsgsPerSubject, err = parseCount(value)
		default:
			return l, fmt.Errorf("retention %q: unknown limit %q (want %s)", s, name, strings.Join(limitNames, ", "))
		}
		if err != nil {
			return l, fmt.Errorf("retention %q: %s=%q: want a non-negative %s", s, name, value, map[bool]string{true: "duration", false: "number"}[name == limitMaxAge])
		}
	}
	return l, nil
}

func parseCount(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, errors.New("bad count")
	}
	return n, nil
}

func parseBytes(s string) (int64, error) {
	mult := int64(1)
	u := strings.ToUpper(s)
	for _, suf := range []struct {
		s string
		m int64
	}{{"TIB", 1 << 40}, {"GIB", 1 << 30}, {"MIB", 1 << 20}, {"KIB", 1 << 10}, {"TB", 1 << 40}, {"GB", 1 << 30}, {"MB", 1 << 20}, {"KB", 1 << 10},
		{"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}, {"B", 1}} {
		if strings.HasSuffix(u, suf.s) {
			mult, u = suf.m, strings.TrimSpace(strings.TrimSuffix(u, suf.s))
			break
		}
	}
	n, err := parseCount(u)
	if err != nil || (n > 0 && n > (1<<62)/mult) {
		return 0, errors.New("bad size")
	}
	return n * mult, nil
}

// String is the canonical form, as --retention takes it ("none" for no
// limit).
func (l Limits) String() string {
	var parts []string
	for _, k := range limitNames {
		if v := l.value(k); v != 0 {
			parts = append(parts, k+"="+l.format(k))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ",")
}

func (l Limits) value(k string) int64 {
	switch k {
	case limitMaxAge:
		return int64(l.MaxAge)
	case limitMaxBytes:
		return l.MaxBytes
	case limitMaxMsgs:
		return l.MaxMsgs
	default:
		return l.MaxMsgsPerSubject
	}
}

func (l *Limits) set(k string, v int64) {
	switch k {
	case limitMaxAge:
		l.MaxAge = time.Duration(v)
	case limitMaxBytes:
		l.MaxBytes = v
	case limitMaxMsgs:
		l.MaxMsgs = v
	default:
		l.MaxMsgsPerSubject = v
	}
}

func (l Limits) format(k string) string {
	v := l.value(k)
	switch {
	case v == 0:
		return "unlimited"
	case k == limitMaxAge:
		return time.Duration(v).String()
	default:
		return strconv.FormatInt(v, 10)
	}
}

// limitsOf reads a stream's limits (JetStream's -1 and 0 are both none).
func limitsOf(sc jetstream.StreamConfig) Limits {
	pos := func(n int64) int64 { return max(n, 0) }
	return Limits{MaxAge: max(sc.MaxAge, 0), MaxBytes: pos(sc.MaxBytes), MaxMsgs: pos(sc.MaxMsgs), MaxMsgsPerSubject: pos(sc.MaxMsgsPerSubject)}
}

// discardsByCount reports whether the size and count limits of a stream
// remove stored messages (discard old); with discard new they refuse new
// ones instead (the capture stops and retries: nothing is lost), so they
// are left as they are. max-age removes messages under either policy.
func discardsByCount(sc jetstream.StreamConfig) bool { return sc.Discard == jetstream.DiscardOld }

// applyLimits sets l on sc, with the record of them in its metadata (the
// size and count limits only under discard old, see discardsByCount).
func applyLimits(sc *jetstream.StreamConfig, l Limits) {
	unlimited := func(n int64) int64 {
		if n == 0 {
			return -1
		}
		return n
	}
	sc.MaxAge = l.MaxAge
	if discardsByCount(*sc) {
		sc.MaxBytes, sc.MaxMsgs, sc.MaxMsgsPerSubject = unlimited(l.MaxBytes), unlimited(l.MaxMsgs), unlimited(l.MaxMsgsPerSubject)
	}
	md := make(map[string]string, len(sc.Metadata)+1)
	for k, v := range sc.Metadata {
		md[k] = v
	}
	md[event.MetaLimits] = l.String()
	sc.Metadata = md
}

// limitChange is one limit of the stream that is not the one asked for.
type limitChange struct {
	name      string
	now, want string
	// foreign: not what the capture set last (changed behind its back).
	foreign bool
	// discards: with the stream's DiscardOld, the current value can
	// remove messages the asked one keeps.
	discards bool
}

func (c limitChange) String() string { return c.name + "=" + c.now }

// limitsPlan compares a stream's config with the limits asked for: what
// differs, and whether the stream records them as the capture's own. A
// stream without a record was made by a capture before records (which
// managed only max-age) or by someone else.
func limitsPlan(sc jetstream.StreamConfig, want Limits) (changes []limitChange, recordOK bool) {
	cur := limitsOf(sc)
	rec := Limits{MaxAge: cur.MaxAge} // no record: only max-age was ever the capture's
	if s, ok := sc.Metadata[event.MetaLimits]; ok {
		if s == "none" {
			s = ""
		}
		r, err := ParseRetention(s)
		if err != nil {
			r = Limits{} // an unreadable record: nothing is known to be ours
		}
		rec = r
	}
	for _, k := range limitNames {
		c, w := cur.value(k), want.value(k)
		if c == w || (k != limitMaxAge && !discardsByCount(sc)) {
			continue
		}
		ch := limitChange{name: k, now: cur.format(k), want: want.format(k), foreign: c != rec.value(k)}
		ch.discards = c != 0 && (w == 0 || c < w)
		changes = append(changes, ch)
	}
	return changes, sc.Metadata[event.MetaLimits] == want.String()
}

// refuseLimits is the one-line refusal of a stream whose limits would
// discard events the capture did not ask to discard.
func refuseLimits(stream string, cs []limitChange, want Limits) error {
	names := make([]string, len(cs))
	var fix []string
	for i, c := range cs {
		names[i] = c.String()
		flag := "--" + c.name + "=-1"
		if c.name == limitMaxAge {
			flag = "--max-age=0"
		}
		fix = append(fix, flag)
	}
	sort.Strings(names)
	return configErr("stream %s has %s, not asked by --retention (%s): it would discard events before every projector applied them, and the archive would miss them; remove it (nats stream edit %s %s) or ask for it with --retention %s",
		stream, strings.Join(names, ", "), want, stream, strings.Join(fix, " "), askFor(cs, want))
}

func askFor(cs []limitChange, want Limits) string {
	l := want
	for _, c := range cs {
		var v int64
		if c.name == limitMaxAge {
			d, _ := time.ParseDuration(c.now)
			v = int64(d)
		} else {
			v, _ = strconv.ParseInt(c.now, 10, 64)
		}
		l.set(c.name, v)
	}
	return l.String()
}

// enforceLimits brings the stream's limits to the asked ones, and its
// purge settings to the ones the capture keeps (guardsPlan). A limit that
// would discard events not asked for and that the capture did not set
// itself (no record, or another value than its record) makes it refuse at
// start (streaming is false); while streaming, and for every other
// difference, the asked limits are restored, logged (a warning when the
// change was made behind the capture's back) and counted. It returns the
// changes it corrected.
func (s *Service) enforceLimits(ctx context.Context, js jetstream.JetStream, sc jetstream.StreamConfig, streaming bool) ([]limitChange, error) {
	want := s.cfg.limits()
	changes, recordOK := limitsPlan(sc, want)
	guards := guardsPlan(sc)
	if len(changes) == 0 && recordOK && !restorable(guards) {
		s.reportGuards(sc.Name, guards, streaming)
		return nil, nil
	}
	if !streaming {
		var refuse []limitChange
		for _, c := range changes {
			if c.discards && c.foreign {
				refuse = append(refuse, c)
			}
		}
		if len(refuse) > 0 {
			return nil, refuseLimits(sc.Name, refuse, want)
		}
	}
	applyLimits(&sc, want)
	applyGuards(&sc)
	if _, err := js.UpdateStream(ctx, sc); err != nil {
		names := make([]string, 0, len(changes)+len(guards))
		for _, c := range changes {
			names = append(names, c.String())
		}
		for _, g := range guards {
			if g.restorable {
				names = append(names, g.name+"="+strconv.FormatBool(g.now))
			}
		}
		return nil, fmt.Errorf("stream %s: restore the limits asked by --retention (%s) and deny_purge over %s: %w", sc.Name, want, strings.Join(names, ", "), err)
	}
	s.reportGuards(sc.Name, guards, streaming)
	for _, c := range changes {
		if c.foreign {
			s.m.limitsRestored.WithLabelValues(c.name).Inc()
			s.log.Warn("stream limit changed behind the capture's back; restored to what --retention asks",
				"stream", sc.Name, "limit", c.name, "was", c.now, "restored", c.want)
		} else {
			s.log.Info("stream limit set as --retention asks", "stream", sc.Name, "limit", c.name, "was", c.now, "now", c.want)
		}
	}
	return changes, nil
}

// startLimits is the limitsEnforcer of a capture starting.
func (s *Service) startLimits(ctx context.Context, js jetstream.JetStream, sc jetstream.StreamConfig) error {
	_, err := s.enforceLimits(ctx, js, sc, false)
	return err
}

// limits are the stream limits the configuration asks for.
func (c *Config) limits() Limits {
	return Limits{MaxAge: c.Retention, MaxBytes: c.RetentionMaxBytes, MaxMsgs: c.RetentionMaxMsgs, MaxMsgsPerSubject: c.RetentionMaxMsgsPerSubject}
}

// LimitsError stops a streaming capture whose stream limits were changed
// behind its back and could not be restored.
type LimitsError struct{ Err error }

func (e *LimitsError) Error() string { return e.Err.Error() }
func (e *LimitsError) Unwrap() error { return e.Err }

// watchLimits checks the stream's limits every StreamCheckInterval while
// streaming and restores them; when that fails the capture stops with a
// *LimitsError naming them (after a soft stop: nothing is lost).
func (s *Service) watchLimits(ctx context.Context, js jetstream.JetStream) {
	defer s.bgWG.Done()
	if s.cfg.StreamCheckInterval < 0 {
		return
	}
	t := time.NewTicker(s.cfg.StreamCheckInterval)
	defer t.Stop()
	name := event.StreamName(s.cfg.SourceName)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		// A stream that cannot be read now (broker unreachable, or the
		// stream gone: publishing fails then) is checked again next time.
		st, err := js.Stream(ctx, name)
		if err != nil {
			continue
		}
		info, err := st.Info(ctx)
		if err != nil {
			continue
		}
		if _, err = s.enforceLimits(ctx, js, info.Config, true); err == nil || ctx.Err() != nil {
			continue
		}
		s.m.limitsRestored.WithLabelValues("failed").Inc()
		le := &LimitsError{Err: err}
		s.limitsErr.Store(le)
		s.log.Error("stream limits cannot be kept; stopping", "err", err)
		s.cancel()
		return
	}
}
