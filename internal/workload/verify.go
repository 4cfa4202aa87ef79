package workload

import (
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// Row is one row image: a ledger row (what was inserted), a delete event's
// row, or an archived row.
type Row struct {
	Table string          // "schema.table"
	ID    int64           // primary key (every shop table has "id")
	Gen   int             // generation (the "gen" column)
	Row   json.RawMessage // the row as a JSON object
	// Origin names where a got row came from (a message id or archive
	// identity), for reports.
	Origin string
}

func (r Row) String() string { return fmt.Sprintf("%s id=%d gen=%d", r.Table, r.ID, r.Gen) }

// Expected returns the rows deleted so far: ledger rows whose (table, id,
// gen) is no longer present.
func Expected(ctx context.Context, url string) ([]Row, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("connect source: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var out []Row
	for _, t := range Tables {
		q := `SELECT (l.pk->>'id')::bigint, l.gen, l.row::text FROM workload.ledger l
			WHERE l.table_name = $1 AND NOT EXISTS (
				SELECT 1 FROM ` + quoteQualified(t) + ` t WHERE t.id = (l.pk->>'id')::bigint AND t.gen = l.gen)
			ORDER BY 1, 2`
		rows, err := conn.Query(ctx, q, t)
		if err != nil {
			return nil, fmt.Errorf("expected rows of %s: %w", t, err)
		}
		for rows.Next() {
			r := Row{Table: t}
			var text string
			if err := rows.Scan(&r.ID, &r.Gen, &text); err != nil {
				rows.Close()
				return nil, fmt.Errorf("expected rows of %s: %w", t, err)
			}
			r.Row = json.RawMessage(text)
			out = append(out, r)
		}
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("expected rows of %s: %w", t, err)
		}
	}
	return out, nil
}

// StreamDeletes reads the whole stream of source with an ordered consumer, up
// to its last sequence at the time of the call, and returns every delete
// event in stream order (opts add credentials). A row kept in the object store (RowRef) is read back
// and checked against its SHA-256, and set as Row.
func StreamDeletes(ctx context.Context, natsURL, source string, opts ...nats.Option) ([]*event.Event, error) {
	r, err := readStream(ctx, natsURL, source, opts...)
	if err != nil || r == nil {
		return nil, err
	}
	defer r.close()
	js, it, last := r.js, r.it, r.last
	stores := map[string]jetstream.ObjectStore{}
	var out []*event.Event
	for {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		msg, err := it.Next()
		if err != nil {
			return nil, fmt.Errorf("read stream: %w", err)
		}
		md, err := msg.Metadata()
		if err != nil {
			return nil, fmt.Errorf("message metadata: %w", err)
		}
		if strings.Contains(msg.Subject(), ".delete.") {
			e, err := event.Decode(msg.Data())
			if err != nil {
				return nil, fmt.Errorf("stream seq %d: %w", md.Sequence.Stream, err)
			}
			if e.RowRef != nil {
				if e.Row, err = readRowRef(ctx, js, stores, e.RowRef); err != nil {
					return nil, fmt.Errorf("stream seq %d: %w", md.Sequence.Stream, err)
				}
			}
			out = append(out, e)
		}
		if md.Sequence.Stream >= last {
			return out, nil
		}
	}
}

func readRowRef(ctx context.Context, js jetstream.JetStream, stores map[string]jetstream.ObjectStore, ref *event.ObjectRef) (json.RawMessage, error) {
	os, ok := stores[ref.Bucket]
	if !ok {
		var err error
		if os, err = js.ObjectStore(ctx, ref.Bucket); err != nil {
			return nil, fmt.Errorf("object store %s: %w", ref.Bucket, err)
		}
		stores[ref.Bucket] = os
	}
	obj, err := os.Get(ctx, ref.Name)
	if err != nil {
		return nil, fmt.Errorf("row object %s/%s: %w", ref.Bucket, ref.Name, err)
	}
	defer obj.Close()
	b, err := io.ReadAll(obj)
	if err != nil {
		return nil, fmt.Errorf("row object %s/%s: %w", ref.Bucket, ref.Name, err)
	}
	sum := sha256.Sum256(b)
	if ref.SHA256 != "" && hex.EncodeToString(sum[:]) != ref.SHA256 {
		return nil, fmt.Errorf("row object %s/%s: sha256 mismatch", ref.Bucket, ref.Name)
	}
	return b, nil
}

// EventRows turns delete events into rows (id and gen read from the row
// image). An event whose row has no "id" is an error: the workload's tables
// all have REPLICA IDENTITY FULL.
func EventRows(events []*event.Event) ([]Row, error) {
	out := make([]Row, 0, len(events))
	for _, e := range events {
		if e.Op != event.OpDelete {
			continue
		}
		var probe struct {
			ID  *int64 `json:"id"`
			Gen *int   `json:"gen"`
		}
		if err := json.Unmarshal(e.Row, &probe); err != nil || probe.ID == nil {
			return nil, fmt.Errorf("event %s: row without id (identity %q)", event.MsgID(e.Source, e.CommitLSN, e.Seq), e.Identity)
		}
		r := Row{Table: e.QualifiedTable(), ID: *probe.ID, Row: e.Row, Origin: event.MsgID(e.Source, e.CommitLSN, e.Seq)}
		if probe.Gen != nil {
			r.Gen = *probe.Gen
		}
		out = append(out, r)
	}
	return out, nil
}

// VerifyStream compares the rows the workload deleted with the delete events
// of the stream (see Compare). compareURL is a database with the shop schema
// (the source). Events of other tables count as unexpected.
func VerifyStream(ctx context.Context, compareURL string, expected []Row, events []*event.Event) (Report, error) {
	got, err := EventRows(events)
	if err != nil {
		return Report{}, err
	}
	rep, err := Compare(ctx, compareURL, expected, got)
	if err != nil {
		return rep, err
	}
	seen := make(map[string]int, len(events))
	for _, e := range events {
		seen[event.MsgID(e.Source, e.CommitLSN, e.Seq)]++
	}
	for id, n := range seen {
		if n > 1 {
			rep.DuplicateMsgIDs = append(rep.DuplicateMsgIDs, id)
		}
	}
	sort.Strings(rep.DuplicateMsgIDs)
	return rep, nil
}

// ArchivedRows reads every row of the archive (view archive.rows) of source.
func ArchivedRows(ctx context.Context, targetURL, source string) ([]Row, error) {
	conn, err := pgx.Connect(ctx, targetURL)
	if err != nil {
		return nil, fmt.Errorf("connect target: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, `SELECT schema_name || '.' || table_name, row::text,
		coalesce((row->>'id')::bigint, -1), coalesce((row->>'gen')::int, 0), commit_lsn::text || '/' || seq
		FROM archive.rows WHERE source = $1`, source)
	if err != nil {
		return nil, fmt.Errorf("read archive: %w", err)
	}
	var out []Row
	for rows.Next() {
		var r Row
		var text string
		if err := rows.Scan(&r.Table, &text, &r.ID, &r.Gen, &r.Origin); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read archive: %w", err)
		}
		r.Row = json.RawMessage(text)
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read archive: %w", err)
	}
	return out, nil
}

// VerifyArchive compares the rows the workload deleted with the archive of
// source "main" in targetURL (see Compare). The target must have the shop
// schema (the usual single-database setup: target = source); otherwise use
// ArchivedRows and Compare against the source.
func VerifyArchive(ctx context.Context, targetURL string, expected []Row) (Report, error) {
	got, err := ArchivedRows(ctx, targetURL, "main")
	if err != nil {
		return Report{}, err
	}
	return Compare(ctx, targetURL, expected, got)
}

// Report is the row-by-row outcome of a comparison. Each list is capped at
// ReportLimit entries; the counts are exact.
type Report struct {
	Expected, Got int
	// Missing: expected, absent from got.
	Missing      []string
	MissingCount int
	// Duplicated: the same (table, id, gen) more than once in got.
	Duplicated      []string
	DuplicatedCount int
	// Unexpected: in got, never deleted by the workload.
	Unexpected      []string
	UnexpectedCount int
	// Different: present in both, values differ (compared as the table's
	// row type, by text).
	Different      []string
	DifferentCount int
	// DuplicateMsgIDs (stream only): the same message id more than once.
	DuplicateMsgIDs []string
}

// ReportLimit caps the examples kept in each list of a Report.
const ReportLimit = 20

// OK is true when got is exactly expected: nothing missing, duplicated,
// unexpected or different.
func (r Report) OK() bool {
	return r.MissingCount == 0 && r.DuplicatedCount == 0 && r.UnexpectedCount == 0 &&
		r.DifferentCount == 0 && len(r.DuplicateMsgIDs) == 0
}

func (r Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "expected=%d got=%d missing=%d duplicated=%d unexpected=%d different=%d duplicate_msg_ids=%d",
		r.Expected, r.Got, r.MissingCount, r.DuplicatedCount, r.UnexpectedCount, r.DifferentCount, len(r.DuplicateMsgIDs))
	for _, l := range []struct {
		name string
		xs   []string
	}{{"missing", r.Missing}, {"duplicated", r.Duplicated}, {"unexpected", r.Unexpected}, {"different", r.Different}, {"duplicate msg id", r.DuplicateMsgIDs}} {
		for i, x := range l.xs {
			if i == 5 {
				fmt.Fprintf(&b, "\n  %s: ...", l.name)
				break
			}
			fmt.Fprintf(&b, "\n  %s: %s", l.name, x)
		}
	}
	return b.String()
}

// Compare loads expected and got into temporary tables of compareURL (a
// database with the shop schema) and compares them row by row: by (table, id,
// gen) for presence and duplicates, and by value as
// jsonb_populate_record(NULL::<table>, row)::text, so a value equal as the
// column's type (numeric "12.50" from a string, a timestamptz in another
// notation) is equal, and anything lossy is not.
func Compare(ctx context.Context, compareURL string, expected, got []Row) (Report, error) {
	rep := Report{Expected: len(expected), Got: len(got)}
	conn, err := pgx.Connect(ctx, compareURL)
	if err != nil {
		return rep, fmt.Errorf("connect compare db: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, t := range []string{"wl_expected", "wl_got"} {
		if _, err := conn.Exec(ctx, "CREATE TEMP TABLE "+t+" (table_name text, id bigint, gen int, row jsonb, origin text)"); err != nil {
			return rep, fmt.Errorf("create %s: %w", t, err)
		}
	}
	load := func(name string, rows []Row) error {
		_, err := conn.CopyFrom(ctx, pgx.Identifier{name}, []string{"table_name", "id", "gen", "row", "origin"},
			pgx.CopyFromSlice(len(rows), func(i int) ([]any, error) {
				r := rows[i]
				return []any{r.Table, r.ID, r.Gen, string(r.Row), r.Origin}, nil
			}))
		if err != nil {
			return fmt.Errorf("load %s: %w", name, err)
		}
		_, err = conn.Exec(ctx, "CREATE INDEX ON "+name+" (table_name, id, gen); ANALYZE "+name)
		return err
	}
	if err := load("wl_expected", expected); err != nil {
		return rep, err
	}
	if err := load("wl_got", got); err != nil {
		return rep, err
	}
	list := func(q string, dst *[]string, n *int, args ...any) error {
		rows, err := conn.Query(ctx, q, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var s string
			if err := rows.Scan(&s); err != nil {
				return err
			}
			*n++
			if len(*dst) < ReportLimit {
				*dst = append(*dst, s)
			}
		}
		return rows.Err()
	}
	const ident = `table_name || ' id=' || id || ' gen=' || gen`
	if err := list(`SELECT `+ident+` FROM wl_expected e WHERE NOT EXISTS
		(SELECT 1 FROM wl_got g WHERE g.table_name = e.table_name AND g.id = e.id AND g.gen = e.gen) ORDER BY 1`,
		&rep.Missing, &rep.MissingCount); err != nil {
		return rep, fmt.Errorf("find missing rows: %w", err)
	}
	if err := list(`SELECT `+ident+` || ' x' || count(*) || ' (' || string_agg(origin, ', ') || ')' FROM wl_got
		GROUP BY table_name, id, gen HAVING count(*) > 1 ORDER BY 1`, &rep.Duplicated, &rep.DuplicatedCount); err != nil {
		return rep, fmt.Errorf("find duplicated rows: %w", err)
	}
	if err := list(`SELECT `+ident+` || ' (' || origin || ')' FROM wl_got g WHERE NOT EXISTS
		(SELECT 1 FROM wl_expected e WHERE g.table_name = e.table_name AND g.id = e.id AND g.gen = e.gen) ORDER BY 1`,
		&rep.Unexpected, &rep.UnexpectedCount); err != nil {
		return rep, fmt.Errorf("find unexpected rows: %w", err)
	}
	tables, err := distinctTables(ctx, conn)
	if err != nil {
		return rep, err
	}
	for _, t := range tables {
		typ := quoteQualified(t)
		q := `SELECT DISTINCT e.table_name || ' id=' || e.id || ' gen=' || e.gen
			FROM wl_expected e JOIN wl_got g USING (table_name, id, gen)
			WHERE e.table_name = $1 AND
			jsonb_populate_record(NULL::` + typ + `, e.row)::text IS DISTINCT FROM jsonb_populate_record(NULL::` + typ + `, g.row)::text
			ORDER BY 1`
		if err := list(q, &rep.Different, &rep.DifferentCount, t); err != nil {
			return rep, fmt.Errorf("compare values of %s: %w", t, err)
		}
	}
	return rep, nil
}

func distinctTables(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	rows, err := conn.Query(ctx, `SELECT DISTINCT e.table_name FROM wl_expected e
		WHERE EXISTS (SELECT 1 FROM wl_got g WHERE g.table_name = e.table_name) ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("list compared tables: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// WaitFor polls cond every interval until it returns true, an error, or
// timeout passes (then the last error or a timeout error).
func WaitFor(ctx context.Context, timeout, interval time.Duration, cond func(context.Context) (bool, error)) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		ok, err := cond(ctx)
		if ok {
			return nil
		}
		last = err
		if time.Now().After(deadline) {
			if last == nil {
				last = errors.New("condition not met")
			}
			return fmt.Errorf("after %s: %w", timeout, last)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(interval):
		}
	}
}

// VerifiedDeletes reads the whole stream of source, as StreamDeletes does,
// and returns the delete events of the transactions whose commit is signed
// with pub and whose Epitaph-Digest is matched by their stored row and
// truncate messages (one per seq, among all stored candidates with that
// commit LSN and seq in the commit's partition: a forgery or a copy
// republished under another id may sit beside the real one), in stream
// order of their commits. Messages of no verified transaction are left out;
// a signed commit that no choice of candidates matches is an error.
func VerifiedDeletes(ctx context.Context, natsURL, source string, pub ed25519.PublicKey, opts ...nats.Option) ([]*event.Event, error) {
	r, err := readStream(ctx, natsURL, source, opts...)
	if err != nil || r == nil {
		return nil, err
	}
	defer r.close()
	rows, commits, err := r.signedTransactions(ctx, pub)
	if err != nil {
		return nil, err
	}
	stores := map[string]jetstream.ObjectStore{}
	var out []*event.Event
	for _, c := range commits {
		chosen, ok := matchDigest(rows[c.key], c.digest)
		if !ok {
			return nil, fmt.Errorf("signed commit at stream seq %d (%s): no choice of its stored rows matches its digest", c.seq, c.key)
		}
		for _, e := range chosen {
			if e.Op != event.OpDelete {
				continue
			}
			if e.RowRef != nil {
				if e.Row, err = readRowRef(ctx, r.js, stores, e.RowRef); err != nil {
					return nil, fmt.Errorf("commit at stream seq %d: %w", c.seq, err)
				}
			}
			out = append(out, e)
		}
	}
	return out, nil
}

// rowCandidate is a stored row or truncate message that may be part of a
// signed transaction.
type rowCandidate struct {
	partSeq uint64
	body    []byte
	ev      *event.Event
}

// signedCommit is a commit message signed with the key VerifiedDeletes
// trusts.
type signedCommit struct {
	key    string // "<partition>/<commit lsn>"
	digest string
	seq    uint64
}

// signedTransactions reads the stream to its end: the row and truncate
// messages by "<partition>/<commit lsn>" and seq, and the commits signed
// with pub, in stream order.
func (r *streamReader) signedTransactions(ctx context.Context, pub ed25519.PublicKey) (map[string]map[int][]rowCandidate, []signedCommit, error) {
	rows := map[string]map[int][]rowCandidate{}
	var commits []signedCommit
	for {
		if ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
		msg, err := r.it.Next()
		if err != nil {
			return nil, nil, fmt.Errorf("read stream: %w", err)
		}
		md, err := msg.Metadata()
		if err != nil {
			return nil, nil, fmt.Errorf("message metadata: %w", err)
		}
		subject := msg.Subject()
		p, perr := event.PartitionOf(subject)
		switch {
		case perr != nil:
		case strings.HasSuffix(subject, ".commit"):
			if event.VerifyMessage(pub, subject, msg.Headers(), msg.Data()) == nil {
				e, err := event.Decode(msg.Data())
				if err != nil {
					return nil, nil, fmt.Errorf("stream seq %d: a signed commit that does not decode: %w", md.Sequence.Stream, err)
				}
				commits = append(commits, signedCommit{key: fmt.Sprintf("%d/%s", p, e.CommitLSN), digest: msg.Headers().Get(event.HeaderDigest), seq: md.Sequence.Stream})
			}
		case strings.Contains(subject, ".delete.") || strings.Contains(subject, ".truncate."):
			addCandidate(rows, p, msg)
		}
		if md.Sequence.Stream >= r.last {
			return rows, commits, nil
		}
	}
}

// addCandidate files a row or truncate message of partition p among rows;
// one without a partition sequence or that does not decode is left out.
func addCandidate(rows map[string]map[int][]rowCandidate, p int, msg jetstream.Msg) {
	ps, err := strconv.ParseUint(msg.Headers().Get(event.HeaderPartitionSeq), 10, 64)
	if err != nil {
		return
	}
	e, err := event.Decode(msg.Data())
	if err != nil {
		return
	}
	k := fmt.Sprintf("%d/%s", p, e.CommitLSN)
	if rows[k] == nil {
		rows[k] = map[int][]rowCandidate{}
	}
	rows[k][e.Seq] = append(rows[k][e.Seq], rowCandidate{partSeq: ps, body: append([]byte(nil), msg.Data()...), ev: e})
}

// matchDigest chooses one candidate per seq, from 0 on, whose digest is
// digest; false when no choice does (within a budget of choices tried:
// many duplicates must not make it exponential).
func matchDigest(byseq map[int][]rowCandidate, digest string) ([]*event.Event, bool) {
	var chosen []*event.Event
	budget := 1_000_000
	var try func(seq int, d *event.Digest) bool
	try = func(seq int, d *event.Digest) bool {
		if budget--; budget < 0 {
			return false
		}
		// The digest decides how many seqs there are: a forgery
		// with another seq must not hide the real transaction.
		if seq > 0 && d.Sum() == digest {
			return true
		}
		state, err := d.MarshalBinary()
		if err != nil {
			return false
		}
		for _, cd := range byseq[seq] {
			var next event.Digest
			if next.UnmarshalBinary(state) != nil {
				return false
			}
			next.Add(cd.partSeq, cd.body)
			chosen = append(chosen, cd.ev)
			if try(seq+1, &next) {
				return true
			}
			chosen = chosen[:len(chosen)-1]
		}
		return false
	}
	// Digest v2 (what a capture writes now), or v1 (a stream written
	// before it).
	if try(0, event.NewDigestV2()) {
		return chosen, true
	}
	chosen, budget = nil, 1_000_000
	if !try(0, event.NewDigest()) {
		return nil, false
	}
	return chosen, true
}

// streamReader reads a whole stream, up to its last sequence at the time it
// was opened, with an ordered consumer.
type streamReader struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	it   jetstream.MessagesContext
	last uint64
}

// readStream opens source's stream for StreamDeletes and VerifiedDeletes;
// nil (and no error) when the stream holds no message.
func readStream(ctx context.Context, natsURL, source string, opts ...nats.Option) (_ *streamReader, err error) {
	nc, err := nats.Connect(natsURL, append([]nats.Option{nats.MaxReconnects(-1)}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("connect nats: %w", err)
	}
	defer func() {
		if err != nil {
			nc.Close()
		}
	}()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	stream, err := js.Stream(ctx, event.StreamName(source))
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", event.StreamName(source), err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream info: %w", err)
	}
	if info.State.Msgs == 0 {
		nc.Close()
		return nil, nil
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{event.StreamSubjects(source)},
		DeliverPolicy:  jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return nil, fmt.Errorf("ordered consumer: %w", err)
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(2000))
	if err != nil {
		return nil, fmt.Errorf("consume: %w", err)
	}
	return &streamReader{nc: nc, js: js, it: it, last: info.State.LastSeq}, nil
}

func (r *streamReader) close() {
	r.it.Stop()
	r.nc.Close()
}
