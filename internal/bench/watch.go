package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
)

// StreamWatch counts the delete messages in a source's stream from outside
// the capture.
type StreamWatch struct {
	nc     *nats.Conn
	js     jetstream.JetStream
	source string
}

// WatchStream connects to natsURL (retrying while the server comes up);
// opts add credentials (see WaitCreds).
func WatchStream(natsURL, source string, opts ...nats.Option) (*StreamWatch, error) {
	nc, err := nats.Connect(natsURL, append([]nats.Option{nats.MaxReconnects(-1), nats.RetryOnFailedConnect(true), nats.ReconnectWait(100 * time.Millisecond)}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("connect nats: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &StreamWatch{nc: nc, js: js, source: source}, nil
}

// Close the connection.
func (w *StreamWatch) Close() { w.nc.Close() }

// JetStream is the watch's JetStream context.
func (w *StreamWatch) JetStream() jetstream.JetStream { return w.js }

// Deletes is the number of delete messages in the stream (0 when the stream
// does not exist yet).
func (w *StreamWatch) Deletes(ctx context.Context) (int64, error) {
	s, err := w.js.Stream(ctx, event.StreamName(w.source))
	if err != nil {
		if err == jetstream.ErrStreamNotFound {
			return 0, nil
		}
		return 0, err
	}
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(event.SubjectPrefix+"."+w.source+".*.delete.>"))
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, c := range info.State.Subjects {
		n += c
	}
	return int64(n), nil
}

// WaitDeletes polls until the stream holds at least n delete messages and
// returns when that was first seen. It fails after timeout, or when alive
// reports the producer dead.
func (w *StreamWatch) WaitDeletes(ctx context.Context, n int64, timeout time.Duration, alive func() error) (time.Time, error) {
	deadline := time.Now().Add(timeout)
	var last int64
	for {
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		got, err := w.Deletes(qctx)
		cancel()
		if err == nil {
			last = got
			if got >= n {
				return time.Now(), nil
			}
		}
		if alive != nil {
			if err := alive(); err != nil {
				return time.Time{}, fmt.Errorf("waiting for %d deletes in the stream (have %d): %w", n, last, err)
			}
		}
		if time.Now().After(deadline) {
			return time.Time{}, fmt.Errorf("waiting for %d deletes in the stream: have %d after %s", n, last, timeout)
		}
		select {
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		case <-time.After(25 * time.Millisecond):
		}
	}
}

// requestTimeout bounds each JetStream request of a watch: a request the
// server took and died before answering (an embedded broker ends with its
// capture, killed or failing at start) is never answered, and nats.go waits
// for it until the caller's context ends: with a test's 10-minute context,
// the wait for a capture's stream hung for the rest of the test.
const requestTimeout = 5 * time.Second

// StreamExists reports whether the source's stream has been created.
func (w *StreamWatch) StreamExists(ctx context.Context) bool {
	qctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	_, err := w.js.Stream(qctx, event.StreamName(w.source))
	return err == nil
}

// Count runs a count query (e.g. of archive.rows) on url; a missing relation
// counts as 0.
func Count(ctx context.Context, url, query string, args ...any) (int64, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int64
	if err := conn.QueryRow(ctx, query, args...).Scan(&n); err != nil {
		if strings.Contains(err.Error(), "SQLSTATE 42P01") || strings.Contains(err.Error(), "SQLSTATE 3F000") {
			return 0, nil
		}
		return 0, err
	}
	return n, nil
}

// Scrape reads a /metrics endpoint and returns every sample summed by metric
// name (labels dropped).
func Scrape(ctx context.Context, addr string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return nil, fmt.Errorf("scrape %s: %s: %s", addr, resp.Status, b)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name := line
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name = line[:i]
		}
		j := strings.LastIndexByte(line, ' ')
		if j < 0 {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(line[j+1:]), 64)
		if err != nil {
			continue
		}
		out[name] += v
	}
	return out, sc.Err()
}

// DeleteTimes is when the server stored the stream's first and last delete
// messages: a drain's start-up and end read from the stream itself, not
// from when a poll of it noticed them (a watch connecting to a capture's
// embedded server while it starts reconnects up to 200 ms after it is up).
func (w *StreamWatch) DeleteTimes(ctx context.Context) (first, last time.Time, err error) {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	s, err := w.js.Stream(ctx, event.StreamName(w.source))
	if err != nil {
		return first, last, err
	}
	subj := event.SubjectPrefix + "." + w.source + ".*.delete.>"
	m, err := s.GetMsg(ctx, 1, jetstream.WithGetMsgSubject(subj))
	if err != nil {
		return first, last, fmt.Errorf("first delete: %w", err)
	}
	l, err := s.GetLastMsgForSubject(ctx, subj)
	if err != nil {
		return first, last, fmt.Errorf("last delete: %w", err)
	}
	return m.Time, l.Time, nil
}

// LastSeq is the stream's last sequence (0 when it does not exist).
func (w *StreamWatch) LastSeq(ctx context.Context) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	s, err := w.js.Stream(ctx, event.StreamName(w.source))
	if err != nil {
		if err == jetstream.ErrStreamNotFound {
			return 0, nil
		}
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.LastSeq, nil
}

// WaitProgress waits until the stream's last sequence passes after, e.g. a
// heartbeat from a restarted capture showing it is streaming again.
func (w *StreamWatch) WaitProgress(ctx context.Context, after uint64, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		last, err := w.LastSeq(ctx)
		if err == nil && last > after {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("stream did not move past sequence %d within %s (last %d, err %v)", after, timeout, last, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Stalled adds a process's epitaph_ metrics and the tail of its log to a wait
// that timed out, after SIGQUIT (a Go program's goroutine stacks go to its
// log).
func Stalled(ctx context.Context, p *Proc, metricsAddr string, err error) error {
	var b strings.Builder
	if m, serr := Scrape(ctx, metricsAddr); serr == nil {
		names := make([]string, 0, len(m))
		for k := range m {
			if strings.HasPrefix(k, "epitaph_") {
				names = append(names, k)
			}
		}
		sort.Strings(names)
		for _, k := range names {
			fmt.Fprintf(&b, "\n  %s %g", k, m[k])
		}
	}
	tail := p.LogTail(4000)
	p.Quit()
	return fmt.Errorf("%w\n%s metrics:%s\n%s log before SIGQUIT (whole log with stacks in %s):\n%s",
		err, p.Name, b.String(), p.Name, p.LogPath, tail)
}

// WaitCaptureReady waits until a capture has made both its stream and its
// replication slot: only deletes after the slot exists reach the stream.
// alive, when set, reports the capture's death.
//
// Every poll is bounded (requestTimeout), so that it fails at its deadline;
// the error says which of the two is missing and, without a slot, what the
// source's walsenders wait for (slot creation waits for every transaction
// running in the cluster: SlotWaits).
func WaitCaptureReady(ctx context.Context, watch *StreamWatch, sourceURL, slot string, timeout time.Duration, alive func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		if alive != nil {
			if err := alive(); err != nil {
				return err
			}
		}
		stream := watch.StreamExists(ctx)
		qctx, cancel := context.WithTimeout(ctx, requestTimeout)
		c, err := Count(qctx, sourceURL, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", slot)
		cancel()
		if stream && err == nil && c > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("capture made no stream and slot %q within %s (stream exists: %t; slot exists: %t, %v)%s",
				slot, timeout, stream, c > 0, err, SlotWaits(ctx, sourceURL))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// sqlSlotWaits lists the source cluster's walsenders of logical
// replication connections that wait, what for, and the sessions and
// prepared transactions that block them (their transaction's age, no query
// text: it may hold data).
const sqlSlotWaits = `
SELECT format('walsender %s (%s, backend for %s) waits on %s/%s, blocked by %s', w.pid, w.datname, now() - w.backend_start,
	coalesce(w.wait_event_type, '-'), coalesce(w.wait_event, '-'),
	coalesce((SELECT string_agg(format('pid %s (database %s, %s, %s, transaction open for %s, xid %s)', b.pid, b.datname,
		coalesce(nullif(b.application_name, ''), b.backend_type), b.state, now() - b.xact_start, b.backend_xid), '; ')
		FROM pg_stat_activity b WHERE b.pid = ANY (pg_blocking_pids(w.pid)) AND b.pid <> 0), 'no session'))
FROM pg_stat_activity w WHERE w.backend_type = 'walsender' AND w.datname IS NOT NULL AND w.wait_event_type IS DISTINCT FROM 'Client'
UNION ALL
SELECT format('prepared transaction %s (database %s, prepared %s ago, xid %s)', p.gid, p.database, now() - p.prepared, p.transaction)
FROM pg_prepared_xacts p`

// SlotWaits describes what creating a replication slot on the source waits
// for (see sqlSlotWaits), one line each, or says why it cannot tell.
func SlotWaits(ctx context.Context, sourceURL string) string {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, sourceURL)
	if err != nil {
		return "\nslot waits: " + err.Error()
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, sqlSlotWaits)
	if err != nil {
		return "\nslot waits: " + err.Error()
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "\nslot waits: " + err.Error()
	}
	if len(lines) == 0 {
		return "\nslot waits: no walsender waits, no prepared transaction"
	}
	return "\nslot waits:\n  " + strings.Join(lines, "\n  ")
}

// WaitCreds waits until the credentials file a capture's embedded broker
// writes on its first start exists (the capture's data dir, nats/), and
// returns the option that authenticates with it.
func WaitCreds(ctx context.Context, path string, timeout time.Duration) (nats.Option, error) {
	deadline := time.Now().Add(timeout)
	for {
		if st, err := os.Stat(path); err == nil && st.Size() > 0 {
			return natsconn.UserCredentials(path), nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no credentials file %s after %s", path, timeout)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// WaitMarksAfter waits until every partition of the stream has a mark
// (a heartbeat's copy) stored after sequence seq: what a capture's
// heartbeat after the stream's last commit publishes, so every
// partition's watermark reaches the last commit once it is applied.
func (w *StreamWatch) WaitMarksAfter(ctx context.Context, seq uint64, timeout time.Duration) error {
	s, err := w.js.Stream(ctx, event.StreamName(w.source))
	if err != nil {
		return err
	}
	parts, err := strconv.Atoi(s.CachedInfo().Config.Metadata[event.MetaPartitions])
	if err != nil {
		return fmt.Errorf("stream metadata %s: %w", event.MetaPartitions, err)
	}
	deadline := time.Now().Add(timeout)
	for p := 0; p < parts; {
		m, err := s.GetLastMsgForSubject(ctx, event.MarkSubject(w.source, p))
		if err == nil && m.Sequence > seq {
			p++
			continue
		}
		if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("partition %d has no mark after stream sequence %d in %s", p, seq, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}
