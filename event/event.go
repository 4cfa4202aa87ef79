// Package event is Epitaph's wire format (version 1): the messages the capture
// publishes to JetStream and the projectors read back. It is shared by both
// sides and imports nothing else of Epitaph's.
//
// Every message is one JSON object with "v":1. A row event is self-contained:
// a rebuild or a quarantine replay needs nothing but the message (and, for a
// row larger than the broker's payload limit, the object it references).
package event

import (
	"encoding/json"
	"time"
)

// Version is the wire format version this package writes and reads.
const Version = 1

// Header names set on every published message.
const (
	HeaderMsgID   = "Nats-Msg-Id"
	HeaderVersion = "Epitaph-Version"
)

// HeaderPublicKey is on signed messages beside Epitaph-Key-Id: the signing
// public key (PublicKeyString). It is not believed for itself: a projector
// that trusts no key yet trusts it on first use when it verifies the
// message's signature; after that only keys recorded in
// its target count.
const HeaderPublicKey = "Epitaph-Public-Key"

// Op is the kind of message.
type Op string

// The message kinds of wire format v1.
const (
	OpDelete   Op = "delete"
	OpTruncate Op = "truncate"
	OpCommit   Op = "commit"
	OpMark     Op = "mark"
	OpGap      Op = "gap"
)

// Replica identity of the table a row event came from.
const (
	IdentityFull    = "full"
	IdentityKey     = "key"
	IdentityNothing = "nothing"
)

// Mark kinds.
const (
	MarkHeartbeat = "heartbeat" // emitted by the capture on a timer
	MarkUser      = "mark"      // pg_logical_emit_message with prefix epitaph.mark
)

// Logical decoding message prefixes (pg_logical_emit_message) the capture
// reacts to.
const (
	// PrefixMark, or a prefix starting with PrefixMark + ".", gives a mark
	// event (MarkUser) on every partition, with the message's content.
	PrefixMark = "epitaph.mark"
	// PrefixHeartbeat is the capture's own timer message: a heartbeat mark
	// (MarkHeartbeat) on every partition.
	PrefixHeartbeat = "epitaph.heartbeat"
	// PrefixGap is the message the capture (or its DDL guard) writes in the
	// same transaction as it removes a table from the publication: the
	// stream then gets a gap for that table at exactly that point of the
	// WAL, in order with the rows around it, once, whatever restarts
	// follow.
	PrefixGap = "epitaph.gap"
)

// Gap kinds: what a gap says was lost. A gap event carries GapLostUpstream
// (its default when "kind" is absent, as in streams written before kinds
// existed); the projector records the others itself in archive.gaps
// (GapRemovedFromStream: events removed from the stream before a version
// applied them; GapTruncate: a TRUNCATE, whose rows are not in the WAL).
const (
	GapLostUpstream      = "lost_upstream"
	GapRemovedFromStream = "removed_from_stream"
	GapTruncate          = "truncate"
)

// Column describes one column of a row event, in table order.
type Column struct {
	Name string `json:"name"`
	// Type is the column's type as Postgres names it (format_type), e.g.
	// "bigint", "numeric(12,2)", "text[]", "public.mood".
	Type string `json:"type"`
	PK   bool   `json:"pk,omitempty"`
	// Generated is a generated column (GENERATED ALWAYS AS ... STORED):
	// PostgreSQL computes it, pgoutput does not send it (before
	// PostgreSQL 18), so it is never in Row or Key, and a restore leaves it
	// to the server.
	Generated bool `json:"generated,omitempty"`
}

// Ref is one foreign key of the table: Columns of this table reference
// RefColumns of Schema.Table.
type Ref struct {
	Columns    []string `json:"columns"`
	Schema     string   `json:"schema"`
	Table      string   `json:"table"`
	RefColumns []string `json:"ref_columns"`
}

// ObjectRef points at a value kept outside the message because it was larger
// than the broker's payload limit. The object holds the JSON text of the row.
type ObjectRef struct {
	Bucket string `json:"bucket"`
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	// SHA256 is the hex digest of the object's bytes, checked on read.
	SHA256 string `json:"sha256"`
}

// Event is one message of the stream. Which fields are set depends on Op;
// Validate says what each op requires.
//
// Values in Key and Row are lossless: a Postgres text representation as a
// JSON string, except booleans (JSON true/false), smallint/integer/bigint/oid
// (JSON numbers, exact digits), real/double precision (JSON numbers, or the
// strings "NaN", "Infinity", "-Infinity"), jsonb objects and arrays
// (embedded JSON) and SQL NULL (null). Numeric is always a string, and so is
// a jsonb scalar (its JSON text, so that a jsonb null stays distinct from a
// SQL NULL). Key and Row are kept as raw JSON so a
// projector can store them without re-encoding.
type Event struct {
	V          int       `json:"v"`
	Op         Op        `json:"op"`
	Source     string    `json:"source"`
	Schema     string    `json:"schema,omitempty"`
	Table      string    `json:"table,omitempty"`
	XID        int64     `json:"xid,omitempty"`
	CommitLSN  LSN       `json:"commit_lsn,omitempty"`
	CommitTime time.Time `json:"commit_time,omitzero"`
	Seq        int       `json:"seq"`

	// Row events (delete).
	Identity string          `json:"identity,omitempty"`
	Columns  []Column        `json:"columns,omitempty"`
	Key      json.RawMessage `json:"key,omitempty"`
	Row      json.RawMessage `json:"row,omitempty"`
	RowRef   *ObjectRef      `json:"row_ref,omitempty"`
	Refs     []Ref           `json:"refs,omitempty"`

	// Truncate.
	Cascade         bool `json:"cascade,omitempty"`
	RestartIdentity bool `json:"restart_identity,omitempty"`

	// Commit: number of published rows, and per "schema.table" counts.
	Rows   int            `json:"rows,omitempty"`
	Tables map[string]int `json:"tables,omitempty"`

	// Mark, heartbeat and gap: the partition the copy was published to and
	// the source position it stands for. Kind is the mark's kind, or the
	// gap's (GapKind). A gap that concerns one table only (a table that lost
	// its replica identity) names it in Schema and Table; a gap without them
	// concerns every table.
	Partition int       `json:"partition,omitempty"`
	LSN       LSN       `json:"lsn,omitempty"`
	Kind      string    `json:"kind,omitempty"`
	Content   string    `json:"content,omitempty"`
	Time      time.Time `json:"time,omitzero"`
	// Gap: the range of source WAL whose deletes were lost upstream.
	FromLSN LSN    `json:"from_lsn,omitempty"`
	ToLSN   LSN    `json:"to_lsn,omitempty"`
	Reason  string `json:"reason,omitempty"`
}

// GapKind is the kind of a gap event: Kind, or GapLostUpstream when the
// event has none.
func (e *Event) GapKind() string {
	if e.Kind == "" {
		return GapLostUpstream
	}
	return e.Kind
}

// QualifiedTable is "schema.table", the form used in commit counts and refs.
func (e *Event) QualifiedTable() string { return e.Schema + "." + e.Table }

// CorrelationID names the source transaction: "<src>:<xid>:<commit_lsn>".
func (e *Event) CorrelationID() string {
	return CorrelationID(e.Source, e.XID, e.CommitLSN)
}

// CorrelationID names a source transaction: "<src>:<xid>:<commit_lsn>".
func CorrelationID(source string, xid int64, commitLSN LSN) string {
	return source + ":" + itoa(xid) + ":" + commitLSN.String()
}

// Encode returns the JSON body of e with V set to Version.
func Encode(e *Event) ([]byte, error) {
	e.V = Version
	return json.Marshal(e)
}
