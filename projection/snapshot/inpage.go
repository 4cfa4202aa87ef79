package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/tidwall/gjson"

	"github.com/epitaph-dev/epitaph/event"
)

// Row is one archive row of a source transaction as the host that archives
// it holds it in memory: the values it stored in <schema>.rows.
type Row struct {
	Schema, Table string
	Identity      string
	Key           json.RawMessage // NULL when empty
	Row           json.RawMessage // NULL when empty
	Refs          []event.Ref
	Seq           int
	CommitTime    time.Time // zero: stored NULL
}

// Group is one source transaction whose rows the caller's transaction has
// just archived, every one of them, with the commit that ends it.
type Group struct {
	Commit *event.Event
	Rows   []Row
	// ArchivedAt is the archived_at the rows were stored with (the
	// archiving transaction's now(), as RETURNING gave it).
	ArchivedAt time.Time
}

// createAssembledSQL writes jobs whose documents are already assembled.
// Each distinct expected_tables is sent and parsed once ($7, by index
// $8): the jobs of a transaction share their commit's counts. Empty
// payload and reason are NULL.
const createAssembledSQL = `
INSERT INTO %s (correlation_id, source, commit_lsn, root_table, root_key, root_seq, expected_tables, expected_rows,
                status, payload, fingerprint, retry_count, failure_reason, completed_at, pending_since)
SELECT u.correlation_id, u.source, u.commit_lsn::pg_lsn, u.root_table, u.root_key::jsonb, u.root_seq,
       e.tables, u.expected_rows, u.status, nullif(u.payload, '')::jsonb, u.fingerprint, u.retry_count,
       nullif(u.reason, ''), CASE u.status WHEN 'complete' THEN now() END, NULL
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int[], $8::int[], $9::int[],
              $10::text[], $11::text[], $12::text[], $13::int[], $14::text[])
       AS u(correlation_id, source, commit_lsn, root_table, root_key, root_seq, expected, expected_rows,
            status, payload, fingerprint, retry_count, reason)
  JOIN (SELECT t.i::int, t.x::jsonb FROM unnest($7::text[]) WITH ORDINALITY AS t(x, i)) AS e(i, tables)
    ON e.i = u.expected
ON CONFLICT (correlation_id, root_table, root_key) DO NOTHING`

// recordGroupsSQL is recordGroupSQL for many transactions.
const recordGroupsSQL = `
INSERT INTO %s (correlation_id, source, commit_lsn, roots, expected_tables, expected_rows)
SELECT u.correlation_id, u.source, u.commit_lsn::pg_lsn, $4, u.expected::jsonb, u.expected_rows
  FROM unnest($1::text[], $2::text[], $3::text[], $5::text[], $6::int[])
       AS u(correlation_id, source, commit_lsn, expected, expected_rows)
ON CONFLICT (correlation_id) DO NOTHING`

// CreateAssembled is CreateJobs for transactions whose rows are all in
// memory: the projector calls it when a transaction's rows and its commit
// are applied by one target transaction (the common case: the transaction
// fits in a page). It assembles the documents of each group's root rows
// ("schema.table" in roots) in memory, with the code and rules the batch
// uses, and writes them complete (or failed, as a batch would) in the
// caller's transaction, two statements for all groups: a reader sees the
// documents the moment the commit is visible, with the fingerprint and
// payload a batch would have written from the same rows.
//
// The caller guarantees that Rows are exactly the rows it archived for the
// group in tx (no other rows of the transaction are in <schema>.rows).
// Completeness is still proven, as a batch does: a group whose rows are
// not seqs 0..Rows-1 of the commit, or that has fewer rows of a table
// than the commit counted, is handed to CreateJobs (pending, for the
// batcher), and so is a group a batch would leave pending. Idempotent like
// CreateJobs. It returns the number of jobs created and, of those, how many
// are pending (the batcher's work).
func CreateAssembled(ctx context.Context, tx pgx.Tx, schema string, groups []Group, roots []string) (created, pending int, err error) {
	if len(roots) == 0 || len(groups) == 0 {
		return 0, 0, nil
	}
	a := newAssembler(schema, roots)
	for _, gr := range groups {
		if gr.Commit == nil || gr.Commit.Op != event.OpCommit {
			return a.created, a.pending, errors.New("create assembled snapshot jobs: not a commit event")
		}
		if err := a.add(ctx, tx, gr.Commit, nil, func(tables map[string]int) ([]job, *loadedGroup, bool) {
			return assemble(gr, tables, roots)
		}); err != nil {
			return a.created, a.pending, err
		}
	}
	err = a.flush(ctx, tx)
	return a.created, a.pending, err
}

// CreateFromArchive is CreateAssembled for transactions whose rows are in
// <schema>.rows as tx sees them, earlier pages' and the caller's own: the
// projector calls it for the commits it applies of transactions that span
// pages. It reads the rows of all the commits' transactions with the
// batch's query (one for all), assembles and proves each group with the
// code CreateAssembled and a batch use, and writes the documents complete
// in the caller's transaction, so they are visible with the commit and a
// spanning document is written once (a pending job completed by a batch
// after the commit was written twice, never a HOT update, and its job
// claimed in a transaction of its own). A group a batch would not complete
// now (rows missing or rejected, unreadable refs) gets pending jobs
// (CreateJobs) for the batcher, as before. Idempotent like CreateJobs.
//
// It returns the number of jobs created and the number the caller should
// hand to a batch: the pending ones, and the documents that were already
// there (a replayed commit), which may be pending from before.
func CreateFromArchive(ctx context.Context, tx pgx.Tx, schema string, commits []*event.Event, roots []string) (created, pending int, err error) {
	if len(roots) == 0 || len(commits) == 0 {
		return 0, 0, nil
	}
	a := newAssembler(schema, roots)
	var (
		sources, lsns []string
		load          []*event.Event
		docs          int
	)
	for _, c := range commits {
		if c == nil || c.Op != event.OpCommit {
			return 0, 0, errors.New("create snapshot jobs from the archive: not a commit event")
		}
		// At most a batch's claim of documents in memory at once (a
		// batch takes a huge transaction's jobs in bounded claims): the
		// rest are the batcher's.
		n := rootBound(c, roots)
		if docs+n > maxClaim {
			k, err := CreateJobs(ctx, tx, schema, c, roots)
			if err != nil {
				return a.created, a.pending, err
			}
			a.created, a.pending = a.created+k, a.pending+k
			continue
		}
		docs += n
		load = append(load, c)
		sources, lsns = append(sources, c.Source), append(lsns, c.CommitLSN.String())
	}
	if len(load) == 0 {
		return a.created, a.pending, nil
	}
	lists, loadErr, err := loadRows(ctx, tx, schema, sources, lsns)
	if err != nil {
		return a.created, a.pending, err
	}
	fenced, err := loadFenced(ctx, tx, schema, sources, lsns)
	if err != nil {
		return a.created, a.pending, err
	}
	for _, c := range load {
		k := txKey{c.Source, c.CommitLSN.String()}
		if err := a.add(ctx, tx, c, fenced[k], func(tables map[string]int) ([]job, *loadedGroup, bool) {
			if loadErr[k] != "" {
				return nil, nil, false // the batch fails it, with its reason
			}
			return assembleRows(c, lists[k], fenced[k], tables, roots)
		}); err != nil {
			return a.created, a.pending, err
		}
	}
	written := a.written()
	if err := a.flush(ctx, tx); err != nil {
		return a.created, a.pending, err
	}
	return a.created, a.pending + written - a.inserted, nil
}

// rootBound is at most how many documents commit c's transaction has: the
// rows it counted of root tables, or all of its rows without counts.
func rootBound(c *event.Event, roots []string) int {
	if len(c.Tables) == 0 {
		return c.Rows
	}
	n := 0
	for _, r := range roots {
		n += c.Tables[r]
	}
	return n
}

// assembler collects the assembled documents of many groups for one
// createAssembledSQL, and hands the groups it cannot complete now to
// CreateJobs.
type assembler struct {
	schema   string
	roots    []string
	cfg      Config
	w        assembledJobs
	recorded assembledGroups
	created  int
	pending  int
	inserted int // of w, written by flush
}

func newAssembler(schema string, roots []string) *assembler {
	a := &assembler{schema: schema, roots: roots, cfg: Config{Schema: schema}}
	a.cfg.setDefaults()
	return a
}

func (a *assembler) written() int { return len(a.w.corr) }

// add assembles commit c's group (build returns the jobs and the loaded
// group, false when the group is not provably complete) and queues its
// documents, or makes pending jobs when a batch would not complete them.
func (a *assembler) add(ctx context.Context, tx pgx.Tx, c *event.Event, fenced *fencedTx,
	build func(tables map[string]int) ([]job, *loadedGroup, bool)) error {
	tables, nrows := fenced.counts(c)
	expected, err := json.Marshal(tables)
	if err != nil {
		return fmt.Errorf("create snapshot jobs: encode table counts: %w", err)
	}
	jobs, lg, ok := build(tables)
	outs := make([]outcome, len(jobs))
	for i, j := range jobs {
		if outs[i] = lg.outcome(j, &a.cfg); outs[i].status == StatusPending {
			ok = false
			break
		}
	}
	if !ok {
		n, err := CreateJobs(ctx, tx, a.schema, c, a.roots)
		if err != nil {
			return err
		}
		a.created, a.pending = a.created+n, a.pending+n
		return nil
	}
	for i, j := range jobs {
		root, _ := lg.g.index(j.rootSeq) // a row of the group
		a.w.add(assembledJob{commit: c, job: j, rootKey: lg.g.rows[root].Key, expected: string(expected),
			expectedRows: nrows, out: outs[i], fp: lg.fp})
	}
	if countsRoot(tables, a.roots) {
		a.recorded.add(c, string(expected), nrows)
	}
	return nil
}

// flush writes the queued documents and groups, two statements.
func (a *assembler) flush(ctx context.Context, tx pgx.Tx) error {
	w, recorded := &a.w, &a.recorded
	if len(w.corr) > 0 {
		tag, err := tx.Exec(ctx, fmt.Sprintf(createAssembledSQL, table(a.schema, "snapshots")),
			w.corr, w.sources, w.lsns, w.rootTables, w.rootKeys, w.rootSeqs, w.distinct, w.expected, w.expectedRows,
			w.statuses, w.payloads, w.fps, w.attempts, w.reasons)
		if err != nil {
			return fmt.Errorf("write %d assembled snapshot jobs: %w", len(w.corr), err)
		}
		a.inserted = int(tag.RowsAffected())
		a.created += a.inserted
	}
	if len(recorded.corr) > 0 {
		if _, err := tx.Exec(ctx, fmt.Sprintf(recordGroupsSQL, table(a.schema, "snapshot_groups")),
			recorded.corr, recorded.sources, recorded.lsns, a.roots, recorded.expected, recorded.expectedRows); err != nil {
			return fmt.Errorf("record %d snapshot groups: %w", len(recorded.corr), err)
		}
	}
	return nil
}

// assemble turns a group into the jobs CreateJobs would make (one per
// distinct key of a root table, at its first deletion) and the loaded
// group a batch would read; false when the group is not provably the
// whole transaction (or a root row has no key), so the batcher must do it.
func assemble(gr Group, tables map[string]int, roots []string) ([]job, *loadedGroup, bool) {
	list := make([]*archiveRow, 0, len(gr.Rows))
	slab := make([]archiveRow, len(gr.Rows)) // one allocation, not one a row
	for i, r := range gr.Rows {
		slab[i] = archiveRow{
			Schema: r.Schema, Table: r.Table, Identity: r.Identity, Key: r.Key, Row: r.Row, Refs: r.Refs,
			CommitLSN: gr.Commit.CommitLSN, Seq: r.Seq,
			// As stored: timestamptz keeps microseconds.
			CommitTime: r.CommitTime.Truncate(time.Microsecond),
			ArchivedAt: gr.ArchivedAt,
		}
		list = append(list, &slab[i])
	}
	return assembleRows(gr.Commit, list, nil, tables, roots)
}

// assembleRows is assemble over rows as a batch reads them: false unless
// they and the fenced rows are exactly seqs 0..Rows-1 of commit c, as many
// of each table as it counted less the fenced ones (tables).
func assembleRows(c *event.Event, list []*archiveRow, fenced *fencedTx, tables map[string]int, roots []string) ([]job, *loadedGroup, bool) {
	var gone []int
	if fenced != nil {
		gone = fenced.seqs
	}
	if len(list)+len(gone) != c.Rows || len(list) == 0 {
		return nil, nil, false
	}
	seen := make([]bool, c.Rows)
	for _, s := range gone {
		if s < 0 || s >= c.Rows || seen[s] {
			return nil, nil, false
		}
		seen[s] = true
	}
	for _, r := range list {
		if r.Seq < 0 || r.Seq >= c.Rows || seen[r.Seq] {
			return nil, nil, false
		}
		seen[r.Seq] = true
	}
	g := newGroup(c.CorrelationID(), list)
	if missing(tables, g.counts()) != "" {
		return nil, nil, false
	}
	// One job per (root table, key), rooted at the first deletion
	// (createJobsSQL's DISTINCT ON ... ORDER BY seq); g.rows is by seq.
	var jobs []job
	var rootSeqs []int
	have := map[string]bool{}
	for _, r := range g.rows {
		q := r.qualified()
		if !slices.Contains(roots, q) {
			continue
		}
		k, ok := keyIdentity(r.Key)
		if !ok {
			return nil, nil, false
		}
		if id := q + "\x00" + k; !have[id] {
			have[id] = true
			jobs = append(jobs, job{correlationID: g.correlationID, source: c.Source, commitLSN: c.CommitLSN.String(),
				rootTable: q, rootSeq: r.Seq, expected: tables})
			rootSeqs = append(rootSeqs, r.Seq)
		}
	}
	return jobs, newLoadedGroup(g, rootSeqs), true
}

// keyIdentity is a string equal for keys canonicalJSON makes equal, and
// false where it says false. A key is almost always a flat object of
// scalars: for those it is the members sorted by name, each name and value
// length-prefixed with the value's type, read by gjson (decoding every
// root's key with encoding/json and encoding it again was a tenth of
// assembly); anything else (nesting, not an object) is canonicalJSON's.
func keyIdentity(raw json.RawMessage) (string, bool) {
	s := string(raw)
	if !gjson.Valid(s) {
		return "", false
	}
	obj := gjson.Parse(s)
	if !obj.IsObject() {
		return canonicalJSON(raw)
	}
	type member struct{ name, value string }
	var members []member
	flat := true
	obj.ForEach(func(k, v gjson.Result) bool {
		var value string
		switch v.Type {
		case gjson.String:
			value = "s" + v.Str
		case gjson.Number:
			value = "n" + strings.TrimSpace(v.Raw) // json.Number keeps the literal
		case gjson.True, gjson.False, gjson.Null:
			value = v.Raw
		default:
			flat = false
			return false
		}
		members = append(members, member{k.Str, value})
		return true
	})
	if !flat {
		return canonicalJSON(raw)
	}
	// Stable: of a repeated name the last member counts, as decoding it
	// into a map keeps the last.
	slices.SortStableFunc(members, func(a, b member) int { return strings.Compare(a.name, b.name) })
	n := 1
	for _, m := range members {
		n += len(m.name) + len(m.value) + 8
	}
	b := make([]byte, 0, n)
	b = append(b, '{')
	for i, m := range members {
		if i+1 < len(members) && members[i+1].name == m.name {
			continue
		}
		b = strconv.AppendInt(b, int64(len(m.name)), 10)
		b = append(append(b, ':'), m.name...)
		b = strconv.AppendInt(b, int64(len(m.value)), 10)
		b = append(append(b, ':'), m.value...)
	}
	return bytesString(b), true
}

// canonicalJSON is a JSON value with object keys sorted and no
// insignificant space, so that equal jsonb keys compare equal; false for
// a missing or unreadable value.
func canonicalJSON(raw json.RawMessage) (string, bool) {
	if len(raw) == 0 {
		return "", false
	}
	d := json.NewDecoder(strings.NewReader(string(raw)))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil || v == nil {
		return "", false
	}
	b, err := json.Marshal(v)
	if err != nil {
		return "", false
	}
	return string(b), true
}

// assembledJobs are the columns of createAssembledSQL's unnest.
type assembledJobs struct {
	corr, sources, lsns, rootTables, rootKeys []string
	rootSeqs                                  []int32
	distinct                                  []string // expected_tables values
	expected                                  []int32  // 1-based index into distinct
	index                                     map[string]int32
	expectedRows                              []int32
	statuses                                  []string
	payloads, fps, reasons                    []string // "": NULL (payload, reason)
	attempts                                  []int32
}

// assembledJob is one row of assembledJobs: a job of commit's
// transaction, assembled in memory.
type assembledJob struct {
	commit       *event.Event
	job          job
	rootKey      json.RawMessage
	expected     string // the transaction's expected_tables
	expectedRows int
	out          outcome
	fp           string
}

func (w *assembledJobs) add(r assembledJob) {
	w.corr = append(w.corr, r.job.correlationID)
	w.rootKeys = append(w.rootKeys, string(r.rootKey))
	w.sources = append(w.sources, r.commit.Source)
	w.lsns = append(w.lsns, r.job.commitLSN)
	w.rootTables = append(w.rootTables, r.job.rootTable)
	w.rootSeqs = append(w.rootSeqs, int32(r.job.rootSeq))
	i, ok := w.index[r.expected]
	if !ok {
		if w.index == nil {
			w.index = map[string]int32{}
		}
		w.distinct = append(w.distinct, r.expected)
		i = int32(len(w.distinct))
		w.index[r.expected] = i
	}
	w.expected = append(w.expected, i)
	w.expectedRows = append(w.expectedRows, int32(r.expectedRows))
	w.statuses = append(w.statuses, r.out.status)
	w.payloads = append(w.payloads, bytesString(r.out.payload))
	w.fps = append(w.fps, r.fp)
	w.attempts = append(w.attempts, int32(r.out.attempts))
	w.reasons = append(w.reasons, r.out.reason)
}

// assembledGroups are the columns of recordGroupsSQL's unnest.
type assembledGroups struct {
	corr, sources, lsns, expected []string
	expectedRows                  []int32
}

func (g *assembledGroups) add(c *event.Event, expected string, expectedRows int) {
	g.corr = append(g.corr, c.CorrelationID())
	g.sources = append(g.sources, c.Source)
	g.lsns = append(g.lsns, c.CommitLSN.String())
	g.expected = append(g.expected, expected)
	g.expectedRows = append(g.expectedRows, int32(expectedRows))
}
