package capture

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
)

// factsTable keeps, per publication, what the capture last read of each
// relation it decoded or published (its keys, foreign keys, generated
// columns: tableFacts), so that a capture restarted after a table was
// dropped still has that table's keys for the deletes left in the slot.
// The catalog is the source of truth while the relation exists; the record
// is read only for one that no longer does. It sits beside the replica
// identity record, in the capture's own schema (never published), and
// capture uninstall removes it.
const factsTable = stateSchema + ".relation_facts"

const sqlFactsTable = `
CREATE SCHEMA IF NOT EXISTS ` + stateSchema + `;
CREATE TABLE IF NOT EXISTS ` + factsTable + ` (
  publication text NOT NULL,
  relid oid NOT NULL,
  relation text NOT NULL,
  facts jsonb NOT NULL,
  recorded_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (publication, relid))`

// A write that changes nothing writes nothing.
const sqlSaveFacts = `
INSERT INTO ` + factsTable + ` AS f (publication, relid, relation, facts)
VALUES ($1, $2, $2::oid::regclass::text, $3)
ON CONFLICT (publication, relid) DO UPDATE SET facts = excluded.facts, relation = excluded.relation, recorded_at = now()
WHERE f.facts IS DISTINCT FROM excluded.facts OR f.relation IS DISTINCT FROM excluded.relation`

const sqlLoadFacts = `SELECT facts FROM ` + factsTable + ` WHERE publication = $1 AND relid = $2`

// factsStore reads and writes the facts record. Its failures never stop
// the capture: a store that cannot write (a role without CREATE on the
// database, a standby, which reads the primary's record) warns once and
// keeps the facts in memory only, as before the record existed.
type factsStore struct {
	pool        *pgxpool.Pool
	publication string
	log         *slog.Logger
	readable    atomic.Bool
	writable    atomic.Bool
	warned      atomic.Bool
}

// newFactsStore makes the record when it is missing (not on a standby,
// which cannot write) and says whether it can be read and written.
func newFactsStore(ctx context.Context, pool *pgxpool.Pool, publication string, standby bool, log *slog.Logger) *factsStore {
	st := &factsStore{pool: pool, publication: publication, log: log}
	var exists bool
	err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, factsTable).Scan(&exists)
	if err == nil && !exists && !standby {
		_, err = pool.Exec(ctx, sqlFactsTable)
		exists = err == nil
	}
	if err == nil && exists {
		var r, w bool
		r, w, err = tablePrivileges(ctx, pool, factsTable, "INSERT", "UPDATE")
		st.readable.Store(r)
		st.writable.Store(w && !standby)
		if err == nil && (!r || !w) && !standby {
			err = errors.New("permission denied: grant SELECT, INSERT, UPDATE ON " + factsTable + " to the capture's role")
		}
	}
	if err != nil || (!exists && !standby) {
		st.warn(err)
	}
	return st
}

// tablePrivileges reports whether the role may read table and whether it
// holds every one of write. Each privilege is asked on its own:
// has_table_privilege with a list is true when any one of them is held.
func tablePrivileges(ctx context.Context, pool *pgxpool.Pool, table string, write ...string) (read, writeAll bool, err error) {
	err = pool.QueryRow(ctx, `SELECT has_table_privilege($1, 'SELECT'), bool_and(has_table_privilege($1, p)) FROM unnest($2::text[]) p`,
		table, write).Scan(&read, &writeAll)
	return read, writeAll, err
}

func (st *factsStore) warn(err error) {
	if st.warned.Swap(true) {
		return
	}
	if err == nil {
		err = errors.New("the record is missing")
	}
	st.log.Warn("cannot keep what the capture read of the published tables on the source (only in memory): "+
		"deletes of a table dropped while the capture is stopped are archived without a key",
		"table", factsTable, "err", redactErr(err))
}

// factsRecord is tableFacts as the record holds it.
type factsRecord struct {
	PK          []string        `json:"pk,omitempty"`
	ReplIdx     []string        `json:"repl_idx,omitempty"`
	Refs        []event.Ref     `json:"refs,omitempty"`
	Generated   []generatedJSON `json:"generated,omitempty"`
	Partitioned bool            `json:"partitioned,omitempty"`
	WeakLeaves  bool            `json:"weak_leaves,omitempty"`
	IndexLeaves bool            `json:"index_leaves,omitempty"`
	PKPos       []int           `json:"pk_pos,omitempty"`
	NCols       int             `json:"ncols"`
	PartCols    []string        `json:"part_cols,omitempty"`
}

type generatedJSON struct {
	Name  string `json:"name"`
	Type  string `json:"type"`
	After string `json:"after,omitempty"`
}

func recordOf(f tableFacts) factsRecord {
	r := factsRecord{PK: f.pk, ReplIdx: f.replIdx, Refs: f.refs, Partitioned: f.partitioned, WeakLeaves: f.weakLeaves,
		IndexLeaves: f.indexLeaves, PKPos: f.pkPos, NCols: f.ncols, PartCols: f.partCols}
	for _, g := range f.generated {
		r.Generated = append(r.Generated, generatedJSON{Name: g.name, Type: g.typ, After: g.after})
	}
	return r
}

func (r factsRecord) facts() tableFacts {
	f := tableFacts{exists: true, pk: r.PK, replIdx: r.ReplIdx, refs: r.Refs, partitioned: r.Partitioned, weakLeaves: r.WeakLeaves,
		indexLeaves: r.IndexLeaves, pkPos: r.PKPos, ncols: r.NCols, partCols: r.PartCols}
	for _, g := range r.Generated {
		f.generated = append(f.generated, generatedColumn{name: g.Name, typ: g.Type, after: g.After})
	}
	return f
}

// save records f, the facts just read of relation relID.
func (st *factsStore) save(ctx context.Context, relID uint32, f tableFacts) {
	if st == nil || !st.writable.Load() {
		return
	}
	b, err := json.Marshal(recordOf(f))
	if err == nil {
		_, err = st.pool.Exec(ctx, sqlSaveFacts, st.publication, relID, b)
	}
	if err != nil && ctx.Err() == nil {
		st.writable.Store(false)
		st.warn(err)
	}
}

// load returns the facts recorded of relation relID, ok=false when there
// are none (or the record cannot be read).
func (st *factsStore) load(ctx context.Context, relID uint32) (tableFacts, bool) {
	if st == nil || !st.readable.Load() {
		return tableFacts{}, false
	}
	var b []byte
	err := st.pool.QueryRow(ctx, sqlLoadFacts, st.publication, relID).Scan(&b)
	if errors.Is(err, pgx.ErrNoRows) {
		return tableFacts{}, false
	}
	var r factsRecord
	if err == nil {
		err = json.Unmarshal(b, &r)
	}
	if err != nil {
		if ctx.Err() == nil {
			st.warn(err)
		}
		return tableFacts{}, false
	}
	return r.facts(), true
}
