package capture

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/lowgc"
)

const (
	receiveWait      = 500 * time.Millisecond
	statusInterval   = 10 * time.Second
	maxInFlightBytes = 64 << 20 // bytes of un-acknowledged message bodies
	payloadHeadroom  = 4096     // headers of a message, under the broker's max payload
)

// streamer is the replication loop's state. It runs on one goroutine.
//
// pgoutput's BEGIN carries the transaction's commit LSN, so its partition
// (event.Partition) is known at once and rows are published as they
// arrive: a transaction is never held in memory. Delete and truncate
// messages share the transaction's seq counter (event.MsgID); the commit
// counts only deletes in rows and tables.
type streamer struct {
	s      *Service
	conn   *pgconn.PgConn
	js     jetstream.JetStream
	obs    jetstream.ObjectStore
	cat    *catalog
	rels   map[uint32]*relation
	tr     *tracker
	src    string
	parts  int
	maxMsg int // largest body published inline

	resuming  bool
	resume    position
	lastMsgID string // "" for the first message of a session: expect nothing

	// Trust (see trust.go): the signing key, each partition's last
	// Epitaph-Partition-Seq, the open transaction's digest, the stored
	// messages the replay may find itself in, and how many more messages
	// are published one at a time, each acknowledged.
	priv    ed25519.PrivateKey
	tagger  *event.MsgIDTagger // every message id's keyed tag (event.MsgIDTagger)
	keyID   string
	pubText string // event.HeaderPublicKey: lets a projector trust the key on first use
	partSeq []uint64
	// recordedSeqs: the partition sequences last recorded outside the
	// stream (seqrecord.go); nil: none yet this session.
	recordedSeqs []uint64
	digest       *event.Digest
	adopt        *adopter
	careful      int
	seqBuf       [20]byte
	sigBuf       []byte
	// recordedLSN: the confirmed position last recorded with
	// recordedSeqs.
	recordedLSN event.LSN

	inTx   bool
	tx     txInfo
	txPart int
	txN    int // messages of this trigger so far (the position index)
	seq    int // row/truncate messages so far
	rows   int
	tables map[string]int

	img     rowImage
	body    []byte // a delete's message body, reused
	hdr     nats.Header
	hdrVals []string
	nc      *nats.Conn
	del     deleteDecoder
	// held is a delete of a partitioned table (its pgoutput message) kept
	// until the next message says whether it is half of a move (movedRow).
	held    []byte
	heldRel *relation // as it was when the delete came
	holding bool
	written event.LSN // highest LSN sent to Postgres as written
	flushed event.LSN // highest LSN sent to Postgres as flushed
	walEnd  event.LSN
	lastSt  time.Time
	lastDL  time.Time

	// looseMsg is the one Msg of every row published without an
	// acknowledgement (see newMsg).
	looseMsg *nats.Msg
}

func (st *streamer) now() time.Time { return st.s.now() }

// tag is the Nats-Msg-Id of a commit, mark, heartbeat or gap whose plain
// id is id: tagged with the signing key (event.MsgIDTagger), so no other
// writer can take it before the capture publishes the message. Without a
// tagger (a test playing an older capture) it is the plain id.
func (st *streamer) tag(id string) string {
	if st.tagger == nil {
		return id
	}
	return st.tagger.Tag(id)
}

// run receives from the slot until ctx ends (a soft stop, returning nil)
// or anything fails (returning the error; nothing past the acknowledged
// and synced messages has been confirmed).
func (st *streamer) run(ctx context.Context) error {
	for {
		if ctx.Err() != nil {
			return nil
		}
		// One clock read per message, for both the tick and the deadline.
		now := st.now()
		if err := st.tickAt(now, false); err != nil {
			return err
		}
		if now.Sub(st.lastDL) > 100*time.Millisecond {
			if err := st.conn.Conn().SetReadDeadline(now.Add(receiveWait)); err != nil {
				return fmt.Errorf("set replication read deadline: %w", err)
			}
			st.lastDL = now
		}
		raw, err := st.conn.ReceiveMessage(context.Background())
		if err != nil {
			// Only the read deadline above is a quiet moment. The kernel
			// giving the connection up (ETIMEDOUT: what was sent stayed
			// unacknowledged for --source-tcp-timeout) is a timeout to
			// net.Error and pgx too, yet the connection is gone.
			if errors.Is(err, os.ErrDeadlineExceeded) {
				st.lastDL = time.Time{}
				continue
			}
			return fmt.Errorf("receive from replication slot %s: %w", st.s.cfg.SlotName, slotErr(st.s.cfg.SlotName, err))
		}
		switch m := raw.(type) {
		case *pgproto3.CopyData:
			if err := st.handleCopyData(ctx, m.Data); err != nil {
				if ctx.Err() != nil && errors.Is(err, context.Canceled) {
					return nil // stopped while waiting for the window: a soft stop
				}
				return err
			}
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("replication slot %s: %w", st.s.cfg.SlotName, slotErr(st.s.cfg.SlotName, pgconn.ErrorResponseToPgError(m)))
		case *pgproto3.CopyDone:
			return &serverEndedError{slot: st.s.cfg.SlotName}
		}
	}
}

func (st *streamer) handleCopyData(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("parse keepalive: %w", err)
		}
		st.walEnd = max(st.walEnd, event.LSN(ka.ServerWALEnd))
		if !st.inTx {
			// Everything committed before ServerWALEnd has been sent to us:
			// once what we published is acknowledged, it may be confirmed,
			// so an idle publication does not hold WAL.
			st.tr.mark(event.LSN(ka.ServerWALEnd), st.now())
			st.s.received.Store(uint64(ka.ServerWALEnd))
		}
		return st.tick(ka.ReplyRequested)
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("parse xlogdata: %w", err)
		}
		st.walEnd = max(st.walEnd, event.LSN(xld.ServerWALEnd))
		if len(xld.WALData) == 0 {
			return nil
		}
		if st.holding && (xld.WALData[0] == byte(pglogrepl.MessageTypeRelation) || xld.WALData[0] == byte(pglogrepl.MessageTypeType)) {
			// pgoutput describes the root again before the first change of
			// each leaf: the insert of a move may come after that.
		} else if st.holding {
			moved, err := st.movedRow(xld.WALData)
			if err != nil {
				return err
			}
			if moved {
				st.holding = false
				st.s.m.partitionMoves.Inc()
				return nil
			}
			if err := st.flushHeld(ctx); err != nil {
				return err
			}
		}
		switch xld.WALData[0] {
		case byte(pglogrepl.MessageTypeDelete):
			d, err := st.del.decode(xld.WALData)
			if err != nil {
				return fmt.Errorf("parse pgoutput message: %w", err)
			}
			if r := st.rels[d.RelationID]; r != nil && r.moveIdx != nil && !st.s.movesOff {
				st.held = append(st.held[:0], xld.WALData...)
				st.holding, st.heldRel = true, r
				return nil
			}
			return st.handleDelete(ctx, d)
		case byte(pglogrepl.MessageTypeInsert):
			// Only the moves publication sends inserts: the one after a
			// held delete was handled above, any other is nothing to us.
			return nil
		}
		msg, err := pglogrepl.Parse(xld.WALData)
		if err != nil {
			return fmt.Errorf("parse pgoutput message: %w", err)
		}
		return st.handle(ctx, msg, xld.ServerTime)
	}
	return nil
}

func (st *streamer) handle(ctx context.Context, msg pglogrepl.Message, serverTime time.Time) error {
	switch m := msg.(type) {
	case *pglogrepl.BeginMessage:
		st.inTx = true
		st.tx = newTxInfo(st.src, m.Xid, event.LSN(m.FinalLSN), m.CommitTime.UTC(), st.tagger)
		st.txPart = event.Partition(st.tx.commitLSN, st.parts)
		st.txN, st.seq, st.rows = 0, 0, 0
		clear(st.tables)
		// Digest v2, unless the transaction's first row is adopted from
		// a stream a v1 capture wrote (see publishMsg).
		st.digest.ResetAlg(!st.s.cfg.digestV1)
	case *pglogrepl.RelationMessage:
		r, err := buildRelation(ctx, relationEnv{cat: st.cat, src: st.src, partitions: st.parts, published: st.s.m.published},
			m, st.rels[m.RelationID])
		if err != nil {
			return err
		}
		st.rels[m.RelationID] = r
		st.s.kickCatalog()
	case *pglogrepl.TypeMessage:
		st.cat.typeNames[m.DataType] = typeIdent(m.Namespace) + "." + typeIdent(m.Name)
	case *pglogrepl.DeleteMessage:
		return st.handleDelete(ctx, m)
	case *pglogrepl.TruncateMessage:
		return st.handleTruncate(ctx, m)
	case *pglogrepl.LogicalDecodingMessage:
		return st.handleMessage(ctx, m, serverTime)
	case *pglogrepl.CommitMessage:
		return st.handleCommit(ctx, m)
	}
	return nil
}

// nextPos returns the position of the next message of the current trigger
// and whether it is already in the stream (a re-send after a restart).
func (st *streamer) nextPos(trigger event.LSN, n *int) (position, bool) {
	p := position{lsn: trigger, n: *n}
	*n++
	if st.resuming {
		if !p.after(st.resume) {
			return p, true
		}
		st.resuming = false
	}
	return p, false
}

func (st *streamer) relationOf(id uint32) (*relation, error) {
	r, ok := st.rels[id]
	if !ok {
		return nil, fmt.Errorf("change for relation %d before its Relation message", id)
	}
	return r, nil
}

// movedRow reports whether msg, the message after the held delete, is
// the other half of a row an UPDATE moved to another partition: PostgreSQL
// writes such a move as the delete from the old partition directly followed
// by the insert into the new one, both sent as changes of the root, equal
// in every key column the partition keys leave out. An application deleting
// a row and at once inserting one with the same such key in the same
// partitioned table looks the same, and is taken for a move too: at commit
// the row still exists.
func (st *streamer) movedRow(msg []byte) (bool, error) {
	if msg[0] != byte(pglogrepl.MessageTypeInsert) {
		return false, nil
	}
	m, err := pglogrepl.Parse(msg)
	if err != nil {
		return false, fmt.Errorf("parse pgoutput message: %w", err)
	}
	ins, ok := m.(*pglogrepl.InsertMessage)
	if !ok || ins.Tuple == nil {
		return false, nil
	}
	d, err := st.del.decode(st.held)
	if err != nil {
		return false, fmt.Errorf("parse pgoutput message: %w", err)
	}
	r := st.heldRel
	if ins.RelationID != d.RelationID || d.OldTuple == nil {
		return false, nil
	}
	cols := r.moveColumns(d.OldTuple)
	if len(cols) == 0 {
		return false, nil
	}
	for _, i := range cols {
		if i >= len(d.OldTuple.Columns) || i >= len(ins.Tuple.Columns) {
			return false, nil
		}
		o, n := d.OldTuple.Columns[i], ins.Tuple.Columns[i]
		if o.DataType != pglogrepl.TupleDataTypeText || n.DataType != pglogrepl.TupleDataTypeText || !bytes.Equal(o.Data, n.Data) {
			return false, nil
		}
	}
	return true, nil
}

// flushHeld handles the held delete as the delete it is.
func (st *streamer) flushHeld(ctx context.Context) error {
	st.holding = false
	d, err := st.del.decode(st.held)
	if err != nil {
		return fmt.Errorf("parse pgoutput message: %w", err)
	}
	return st.deleteOf(ctx, st.heldRel, d)
}

func (st *streamer) handleDelete(ctx context.Context, m *pglogrepl.DeleteMessage) error {
	r, err := st.relationOf(m.RelationID)
	if err != nil {
		return err
	}
	return st.deleteOf(ctx, r, m)
}

// deleteOf publishes m, a delete of a row of r.
func (st *streamer) deleteOf(ctx context.Context, r *relation, m *pglogrepl.DeleteMessage) error {
	seq := st.seq
	st.seq++
	st.rows++
	st.tables[r.qualified()]++
	pos, skip := st.nextPos(st.tx.commitLSN, &st.txN)
	if skip {
		return nil
	}
	// A row whose values alone exceed a message is streamed to the object
	// store from the WAL message (largerow.go).
	stream := false
	if m.OldTuple != nil && len(m.OldTuple.Columns) == len(r.cols) && r.imageSize(m.OldTuple) > largeImage {
		defer lowgc.Hold()() // the row's copies are collected as they fall (internal/lowgc)
		stream = valuesSize(m.OldTuple)+r.head.Size()+512 > st.maxMsg
	}
	st.img.stream = stream
	err := r.encodeRow(&st.img, m.OldTupleType, m.OldTuple)
	st.img.stream = false
	if err != nil {
		return err
	}
	msgID := st.tx.msgID(seq)
	var ref *event.ObjectRef
	if stream || len(st.img.row)+r.head.Size()+len(st.img.key)+512 > st.maxMsg {
		var src io.Reader = bytes.NewReader(st.img.row)
		if stream {
			src = newImageReader(r, m.OldTuple, &st.img)
		}
		ref, err = st.putLargeRow(ctx, msgID, src)
		if err != nil {
			return err
		}
		st.s.m.largeRows.Inc()
	}
	// The body buffer is reused: publishMsg copies it into the
	// connection's write buffer before it returns, and with no retries
	// (WithRetryAttempts(0)) it is never sent again.
	st.body = r.encodeDelete(st.body[:0], &st.tx, seq, &st.img, ref)
	if err := st.publishMsg(ctx, outMsg{subject: r.subjects[st.txPart], part: st.txPart, msgID: msgID,
		pos: st.tx.position(pos.n), body: st.body, what: r.what, kind: kindRow}, ref != nil); err != nil {
		return err
	}
	r.deletes.Inc()
	st.releaseLarge()
	return nil
}

// releaseLarge drops the reused row buffers after a large row, so the
// process does not keep a row's size of memory for the rest of its life.
func (st *streamer) releaseLarge() {
	if cap(st.img.row) > largeImage {
		st.img.row = nil
	}
	if cap(st.body) > largeImage {
		st.body = nil
	}
}

// putLargeRow stores a row too large for one message in the object store,
// under the message id (a re-send overwrites it with the same bytes). The
// row is read from src in chunks; its size and sha256 are taken as it goes.
func (st *streamer) putLargeRow(ctx context.Context, msgID string, src io.Reader) (*event.ObjectRef, error) {
	name := strings.ReplaceAll(msgID, "/", "_")
	h := sha256.New()
	cr := &countingReader{r: io.TeeReader(src, h)}
	if _, err := st.obs.Put(ctx, jetstream.ObjectMeta{Name: name}, cr); err != nil {
		return nil, fmt.Errorf("store large row %s: %w", name, err)
	}
	return &event.ObjectRef{Bucket: event.RowBucket(st.src), Name: name, Size: cr.n, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

func (st *streamer) handleTruncate(ctx context.Context, m *pglogrepl.TruncateMessage) error {
	for _, id := range m.RelationIDs {
		r, err := st.relationOf(id)
		if err != nil {
			return err
		}
		sent, err := st.publishTruncate(ctx, r.schema, r.table, m.Option&pglogrepl.TruncateOptionCascade != 0,
			m.Option&pglogrepl.TruncateOptionRestartIdentity != 0, "truncate "+r.qualified())
		if err != nil {
			return err
		}
		if sent {
			st.s.log.Warn("TRUNCATE captured: the truncated rows are not in the WAL and are NOT archived", "table", r.qualified(), "commit_lsn", st.tx.commitLSN.String())
			r.truncates.Inc()
		}
	}
	return nil
}

// publishTruncate publishes a truncate of schema.table as the current
// transaction's next row message, unless the stream has it already (a
// re-send after a restart: sent is false then).
func (st *streamer) publishTruncate(ctx context.Context, schema, table string, cascade, restartIdentity bool, what string) (sent bool, err error) {
	seq := st.seq
	st.seq++
	pos, skip := st.nextPos(st.tx.commitLSN, &st.txN)
	if skip {
		return false, nil
	}
	e := &event.Event{
		Op: event.OpTruncate, Source: st.src, Schema: schema, Table: table,
		XID: int64(st.tx.xid), CommitLSN: st.tx.commitLSN, CommitTime: st.tx.commitTime, Seq: seq,
		Cascade: cascade, RestartIdentity: restartIdentity,
	}
	body, err := event.Encode(e)
	if err != nil {
		return false, fmt.Errorf("encode truncate: %w", err)
	}
	return true, st.publish(ctx, outMsg{subject: event.TruncateSubject(st.src, st.txPart, schema, table), part: st.txPart,
		msgID: st.tx.msgID(seq), pos: pos.String(), body: body, what: what, kind: kindRow})
}

// handleMessage publishes marks and heartbeats to every partition.
func (st *streamer) handleMessage(ctx context.Context, m *pglogrepl.LogicalDecodingMessage, serverTime time.Time) error {
	var kind string
	switch {
	case m.Prefix == event.PrefixHeartbeat:
		kind = event.MarkHeartbeat
	case m.Prefix == event.PrefixMark || strings.HasPrefix(m.Prefix, event.PrefixMark+"."):
		kind = event.MarkUser
	case m.Prefix == event.PrefixGap:
		return st.handleTableGap(ctx, m, serverTime)
	case m.Prefix == partitionRemovedPrefix:
		return st.handleLeafRemoved(ctx, m)
	case m.Prefix == guardMessagePrefix:
		// The notify guard, on a server with prepared transactions: its
		// transaction has committed. Once more a moment later, in case it
		// was not yet visible to the check.
		st.s.ddlSignal()
		time.AfterFunc(250*time.Millisecond, st.s.kickCatalog)
		return nil
	default:
		return nil
	}
	lsn := event.LSN(m.LSN)
	trigger, n := endTrigger(lsn), 0
	counter := &n
	e := event.Event{Op: event.OpMark, Source: st.src, LSN: lsn, Kind: kind, Time: serverTime.UTC()}
	if kind == event.MarkUser {
		e.Content = string(m.Content)
	}
	if m.Transactional && st.inTx {
		trigger, counter = st.tx.commitLSN, &st.txN
		e.XID, e.CommitLSN, e.CommitTime = int64(st.tx.xid), st.tx.commitLSN, st.tx.commitTime
	}
	for p := 0; p < st.parts; p++ {
		pos, skip := st.nextPos(trigger, counter)
		if skip {
			continue
		}
		e.Partition = p
		body, err := event.Encode(&e)
		if err != nil {
			return fmt.Errorf("encode mark: %w", err)
		}
		if err := st.publish(ctx, outMsg{subject: event.MarkSubject(st.src, p), part: p, msgID: st.tag(event.MarkMsgID(st.src, lsn, p)),
			pos: pos.String(), body: body, what: kind, kind: kindSigned}); err != nil {
			return err
		}
		st.s.m.published.WithLabelValues("", "", string(event.OpMark)).Inc()
	}
	if kind == event.MarkHeartbeat {
		st.s.heartbeatSeen(serverTime)
	}
	if !m.Transactional || !st.inTx {
		// A non-transactional message is re-sent if its own LSN is
		// confirmed; the position check skips it then.
		st.tr.mark(lsn, st.now())
	}
	return nil
}

// handleTableGap publishes the gap of a table removed from the
// publication (see event.PrefixGap) to every partition: from the removal on, the
// table's deletes are not captured until it is added again. A message whose
// content is not a table gap is ignored: anyone may write one, and a gap is
// not believed unless it names a table.
func (st *streamer) handleTableGap(ctx context.Context, m *pglogrepl.LogicalDecodingMessage, serverTime time.Time) error {
	var g tableGap
	if err := json.Unmarshal(m.Content, &g); err != nil || g.Schema == "" || g.Table == "" {
		st.s.log.Warn("ignored a malformed epitaph.gap message", "lsn", event.LSN(m.LSN).String())
		return nil
	}
	lsn := event.LSN(m.LSN)
	trigger, n := endTrigger(lsn), 0
	counter := &n
	if m.Transactional && st.inTx {
		trigger, counter = st.tx.commitLSN, &st.txN
	}
	for p := 0; p < st.parts; p++ {
		pos, skip := st.nextPos(trigger, counter)
		if skip {
			continue
		}
		e := &event.Event{Op: event.OpGap, Source: st.src, Partition: p, Kind: event.GapLostUpstream, Schema: g.Schema, Table: g.Table,
			FromLSN: lsn, ToLSN: lsn, LSN: lsn, Reason: g.Reason, Time: serverTime.UTC()}
		body, err := event.Encode(e)
		if err != nil {
			return fmt.Errorf("encode gap: %w", err)
		}
		if err := st.publish(ctx, outMsg{subject: event.GapSubject(st.src, p), part: p, msgID: st.tag(event.TableGapMsgID(st.src, g.Schema, g.Table, lsn, lsn, p)),
			pos: pos.String(), body: body, what: "gap " + g.Schema + "." + g.Table, kind: kindSigned}); err != nil {
			return err
		}
		st.s.m.published.WithLabelValues(g.Schema, g.Table, string(event.OpGap)).Inc()
	}
	st.s.log.Warn("gap recorded for a table: some of its deletes are not captured",
		"table", g.Schema+"."+g.Table, "lsn", lsn.String(), "reason", g.Reason)
	if !m.Transactional || !st.inTx {
		st.tr.mark(lsn, st.now())
	}
	return nil
}

// endTrigger is the position LSN of messages that stand for an LSN where a
// WAL record ends: a non-transactional message (pgoutput reports the end of
// its record) or a gap (ending at the new slot's consistent point). That is
// where the next record may start, and a transaction whose commit record
// directly follows reports the same LSN as its commit LSN: with equal
// LSNs, positions would not be strictly increasing in output order, and a
// capture resuming after such a message would take the transaction's first
// messages for re-sends and skip them. The LSN just before, inside the
// record, orders them correctly.
func endTrigger(end event.LSN) event.LSN { return end - 1 }

func (st *streamer) handleCommit(ctx context.Context, m *pglogrepl.CommitMessage) error {
	st.inTx = false
	if st.seq > 0 {
		pos, skip := st.nextPos(st.tx.commitLSN, &st.txN)
		if !skip {
			e := &event.Event{
				Op: event.OpCommit, Source: st.src, XID: int64(st.tx.xid),
				CommitLSN: st.tx.commitLSN, CommitTime: st.tx.commitTime,
				Rows: st.rows,
			}
			if st.rows > 0 {
				e.Tables = st.tables
			}
			body, err := event.Encode(e)
			if err != nil {
				return fmt.Errorf("encode commit: %w", err)
			}
			if h := st.s.hooks; h != nil && h.beforeCommit != nil {
				h.beforeCommit(st.tx.commitLSN)
			}
			if err := st.publish(ctx, outMsg{subject: event.CommitSubject(st.src, st.txPart), part: st.txPart, msgID: st.tag(event.CommitMsgID(st.src, st.tx.commitLSN)),
				pos: pos.String(), body: body, what: "commit " + st.tx.commitLSN.String(), kind: kindCommit}); err != nil {
				return err
			}
			st.s.m.published.WithLabelValues("", "", string(event.OpCommit)).Inc()
			st.s.m.transactions.Inc()
		}
		st.s.setLag(st.now().Sub(st.tx.commitTime))
		st.s.rowCommit.Store(uint64(st.tx.commitLSN)) // the quiet heartbeat's cue (heartbeats)
	}
	st.tr.mark(event.LSN(m.TransactionEndLSN), st.now())
	st.s.received.Store(uint64(m.TransactionEndLSN))
	return nil
}

var (
	headerVersion1 = []string{"1"} // shared, never modified
	noRetries      = jetstream.WithRetryAttempts(0)
)

const (
	// ackEvery: at most this many row messages are published in a row
	// without asking for an acknowledgement (bounded by MaxInFlight/4);
	// ackBytes bounds their bodies. Commits, marks, gaps and truncates
	// always ask.
	ackEvery = 64
	ackBytes = 1 << 20
)

// msgKind says how a message is authenticated.
type msgKind uint8

const (
	kindRow    msgKind = iota // a row or truncate: hashed into its transaction's digest
	kindSigned                // a mark, heartbeat or gap: signed
	kindCommit                // a commit: signed, with the transaction's digest
)

// carefulMsgs: a session publishes its first messages one at a time, each
// acknowledged, until this many in a row were not duplicates, so that a
// message whose id a foreign message took is noticed and republished under
// another id (see trust.go).
const carefulMsgs = 256

// outMsg is one message the streamer publishes: its subject, partition,
// Epitaph headers and body. publishMsg sets partSeq, seqText and digest.
type outMsg struct {
	subject string
	part    int
	msgID   string
	pos     string // Epitaph-Position
	body    []byte
	what    string // names the message in errors and logs
	kind    msgKind
	partSeq uint64 // Epitaph-Partition-Seq
	seqText string // partSeq as text (see publishMsg)
	digest  string // a commit's Epitaph-Digest, else empty
}

// publish sends one message asynchronously and asks for its
// acknowledgement, keeping the window of un-acknowledged publishes bounded.
func (st *streamer) publish(ctx context.Context, out outMsg) error {
	return st.publishMsg(ctx, out, true)
}

// publishMsg sends out. Each message expects the
// previous one as the stream's last message id, so if one is lost or
// refused every following one is refused too and the stream stays a prefix
// of what was sent. That is also why most row messages are published
// without asking for an acknowledgement (core NATS, no reply subject): the
// next acknowledged message proves them stored, in order (see tracker), and
// JetStream builds no acknowledgement for them, the client tracks no
// future for them.
//
// Every message carries the partition's next Epitaph-Partition-Seq; a row
// or truncate is hashed into the transaction's digest (one hash update, no
// allocation); a commit carries the digest, and commits, marks, heartbeats
// and gaps are signed.
func (st *streamer) publishMsg(ctx context.Context, out outMsg, ack bool) error {
	out.partSeq = st.partSeq[out.part] + 1
	out.digest = ""
	if out.kind == kindCommit {
		out.digest = st.digest.Sum()
	}
	if st.adopt != nil {
		found, err := st.adoptStored(ctx, out)
		if err != nil || found {
			return err
		}
		st.adopt = nil
	}
	for st.tr.len() > 0 && (st.tr.msgs >= st.s.cfg.MaxInFlight || st.tr.bytes >= maxInFlightBytes) {
		if err := st.tr.waitFront(ctx, st.now); err != nil {
			st.s.m.publishErrors.Inc()
			return err
		}
	}
	if !ack {
		every := min(ackEvery, max(1, st.s.cfg.MaxInFlight/4))
		ack = st.tr.looseMsgs+1 >= every || st.tr.looseSize+len(out.body) >= ackBytes
	}
	// The partition sequence as text without an allocation: the header
	// value is read only while the message is encoded into the
	// connection's buffer, before publishMsg returns, and never again
	// (no retries), so it may point into a buffer reused by the next one.
	n := len(strconv.AppendUint(st.seqBuf[:0], out.partSeq, 10))
	out.seqText = unsafe.String(&st.seqBuf[0], n)
	if out.kind == kindRow {
		st.digest.Add(out.partSeq, out.body)
	}
	// One header map for rows, reused: both publish paths encode it into
	// the connection's buffer before they return, and with no retries
	// (WithRetryAttempts(0)) nothing is sent again from it. Signed
	// messages get their own.
	var h nats.Header
	if out.kind == kindRow {
		h = st.hdr
		if h == nil {
			h = make(nats.Header, 5)
			h[event.HeaderVersion] = headerVersion1
			st.hdr = h
			st.hdrVals = make([]string, 4)
		}
		st.hdrVals[0], st.hdrVals[1], st.hdrVals[2], st.hdrVals[3] = out.pos, out.msgID, st.lastMsgID, out.seqText
		h[HeaderPosition] = st.hdrVals[0:1:1]
		h[jetstream.MsgIDHeader] = st.hdrVals[1:2:2]
		h[event.HeaderPartitionSeq] = st.hdrVals[3:4:4]
		if st.digest.V2() {
			h[event.HeaderDigestAlg] = digestAlgV2Val
		} else {
			delete(h, event.HeaderDigestAlg)
		}
	} else {
		h = nats.Header{
			event.HeaderVersion:      headerVersion1,
			HeaderPosition:           {out.pos},
			jetstream.MsgIDHeader:    {out.msgID},
			event.HeaderPartitionSeq: {out.seqText},
			event.HeaderKeyID:        {st.keyID},
			event.HeaderPublicKey:    {st.pubText},
		}
		st.commitDigest(h, out.digest)
		st.sign(h, out)
	}
	switch {
	case st.lastMsgID != "" && out.kind == kindRow:
		h[jetstream.ExpectedLastMsgIDHeader] = st.hdrVals[2:3:3]
	case st.lastMsgID != "":
		h[jetstream.ExpectedLastMsgIDHeader] = []string{st.lastMsgID}
	default:
		delete(h, jetstream.ExpectedLastMsgIDHeader)
	}
	m := st.newMsg(!ack && st.careful == 0, out.subject, out.body, h)
	if st.careful > 0 {
		id, err := st.publishCareful(ctx, m, out)
		if err != nil {
			st.s.m.publishErrors.Inc()
			return err
		}
		st.partSeq[out.part] = out.partSeq
		st.lastMsgID = id
		return nil
	}
	if ack {
		fut, err := st.js.PublishMsgAsync(m, noRetries)
		if err != nil {
			st.s.m.publishErrors.Inc()
			return fmt.Errorf("publish %s to %s: %w", out.what, out.subject, brokerIO(err))
		}
		st.tr.addSigned(fut, len(out.body), out.what, out.part, signedSeq(out.kind, out.partSeq))
	} else {
		if err := st.publishLoose(m); err != nil {
			st.s.m.publishErrors.Inc()
			return fmt.Errorf("publish %s to %s: %w", out.what, out.subject, brokerIO(err))
		}
		st.tr.loose(len(out.body))
	}
	st.partSeq[out.part] = out.partSeq
	st.lastMsgID = out.msgID
	return nil
}

// adoptStored looks for the message about to be published among the
// stored ones (see adopter). Found, it is counted and hashed, not sent.
//
// A transaction goes on in the digest version its stored rows were
// written in: its first adopted row decides (a transaction begun by a
// capture before digest v2 stays v1, as its commit's digest must cover
// those rows the way they were hashed).
func (st *streamer) adoptStored(ctx context.Context, out outMsg) (bool, error) {
	alg := st.digestAlg()
	if out.kind == kindRow && st.digest.Len() == 0 {
		alg = anyDigestAlg
	}
	found, storedAlg, err := st.adopt.find(ctx, out, alg)
	if err != nil || !found {
		return false, err
	}
	st.partSeq[out.part] = out.partSeq
	if out.kind == kindRow {
		if st.digest.Len() == 0 {
			st.digest.ResetAlg(storedAlg == event.DigestAlgV2)
		}
		st.digest.Add(out.partSeq, out.body)
	}
	return true, nil
}

// commitDigest sets a commit's Epitaph-Digest (digest, empty on other
// signed messages) and, for digest v2, its Epitaph-Digest-Alg.
func (st *streamer) commitDigest(h nats.Header, digest string) {
	if digest == "" {
		return
	}
	h[event.HeaderDigest] = []string{digest}
	if st.digest.V2() {
		h[event.HeaderDigestAlg] = digestAlgV2Val
	}
}

// digestAlgV2Val is the Epitaph-Digest-Alg header value of digest v2,
// shared by every row header (never modified).
var digestAlgV2Val = []string{event.DigestAlgV2}

// anyDigestAlg, as the alg find is asked for, accepts a stored row of
// either digest version (the first row of a transaction).
const anyDigestAlg = "*"

// digestAlg is the Epitaph-Digest-Alg header value of the open
// transaction's messages: "v2", or "" for digest v1.
func (st *streamer) digestAlg() string {
	if st.digest.V2() {
		return event.DigestAlgV2
	}
	return ""
}

// signedSeq is partSeq for a signed message, 0 for a row or truncate: the
// tracker keeps the sequences of signed messages only (see tracker.acked).
func signedSeq(kind msgKind, partSeq uint64) uint64 {
	if kind == kindRow {
		return 0
	}
	return partSeq
}

// newMsg is the message to publish. A loose one (a core publish, no
// acknowledgement) is copied into the connection's buffer and kept by
// nobody: one Msg serves every loose row (see publishLoose). Any other is
// its own (an acknowledgement's future keeps it).
func (st *streamer) newMsg(loose bool, subject string, body []byte, h nats.Header) *nats.Msg {
	if !loose {
		return &nats.Msg{Subject: subject, Data: body, Header: h}
	}
	if st.looseMsg == nil {
		st.looseMsg = new(nats.Msg)
	}
	m := st.looseMsg
	m.Subject, m.Data, m.Header = subject, body, h
	return m
}

// publishLoose publishes a loose message and lets go of the body buffer
// and header map it points to (both reused).
func (st *streamer) publishLoose(m *nats.Msg) error {
	err := st.nc.PublishMsg(m)
	m.Data, m.Header = nil, nil
	return err
}

// sign sets the Epitaph-Signature header of a signed message.
func (st *streamer) sign(h nats.Header, out outMsg) {
	st.sigBuf = event.AppendSigningInput(st.sigBuf[:0], event.SignedFields{Subject: out.subject, MsgID: out.msgID,
		Position: out.pos, PartSeq: out.seqText, Digest: out.digest}, out.body)
	h[event.HeaderSignature] = []string{event.Sign(st.priv, st.sigBuf)}
}

// publishCareful publishes m and waits for its acknowledgement. A
// duplicate means a message the capture did not publish holds its id: m is
// published again under event.RepublishedMsgID (re-signed: the signature
// covers the id) until it is stored. It returns the id it was stored under.
func (st *streamer) publishCareful(ctx context.Context, m *nats.Msg, out outMsg) (string, error) {
	if err := st.tr.drain(ctx, st.now); err != nil {
		return "", err
	}
	id := out.msgID
	for n := 1; ; n++ {
		ack, err := st.js.PublishMsg(ctx, m, noRetries)
		if err != nil {
			return "", fmt.Errorf("publish %s to %s: %w", out.what, m.Subject, brokerIO(err))
		}
		if !ack.Duplicate {
			st.careful--
			st.tr.addSigned(doneFuture(ack), len(m.Data), out.what, out.part, signedSeq(out.kind, out.partSeq))
			return id, nil
		}
		st.careful = carefulMsgs
		st.s.m.collisions.Inc()
		if n > maxRepublish {
			return "", fmt.Errorf("publish %s: %w", out.what, &collisionError{what: out.what, msgID: id, seq: ack.Sequence})
		}
		next := event.RepublishedMsgID(out.msgID, n)
		st.s.log.Warn("message id taken by a foreign message: publishing the capture's message under another id", "msg_id", id, "taken_by_stream_seq", ack.Sequence, "new_msg_id", next, "what", out.what)
		id = next
		if out.kind == kindRow {
			// The row header map is reused: give this message its own.
			h := make(nats.Header, len(m.Header))
			for k, v := range m.Header {
				h[k] = append([]string(nil), v...)
			}
			m.Header = h
		}
		m.Header[jetstream.MsgIDHeader] = []string{id}
		if out.kind != kindRow {
			again := out
			again.msgID = id
			st.sign(m.Header, again)
		}
	}
}

// maxRepublish bounds the ids tried for one message.
const maxRepublish = 100

// resolved is an acknowledgement already received, for the tracker.
type resolved struct {
	ok  chan *jetstream.PubAck
	err chan error
}

func doneFuture(a *jetstream.PubAck) resolved {
	r := resolved{ok: make(chan *jetstream.PubAck, 1), err: make(chan error)}
	r.ok <- a
	return r
}

func (r resolved) Ok() <-chan *jetstream.PubAck { return r.ok }
func (r resolved) Err() <-chan error            { return r.err }

// tick collects acknowledgements and sends a standby status update when the
// confirmable position moved, every statusInterval, or when asked.
func (st *streamer) tick(force bool) error { return st.tickAt(st.now(), force) }

// tickAt is tick with the time already read.
func (st *streamer) tickAt(now time.Time, force bool) error {
	if h := st.s.hooks; h != nil && h.holdAcks != nil && h.holdAcks() {
		return nil
	}
	if err := st.tr.poll(now); err != nil {
		st.s.m.publishErrors.Inc()
		return err
	}
	safe := st.tr.safeLSN(now)
	if !force && safe == st.flushed && st.tr.written == st.written && now.Sub(st.lastSt) < statusInterval {
		return nil
	}
	if !force && now.Sub(st.lastSt) < 200*time.Millisecond && now.Sub(st.lastSt) < statusInterval {
		return nil // batch confirmations under load
	}
	return st.sendStatus(now, safe)
}

func (st *streamer) sendStatus(now time.Time, safe event.LSN) error {
	written := max(st.tr.written, safe)
	if safe == 0 {
		// pglogrepl sends the write position as flush when flush is 0, which
		// would confirm what is not safe yet.
		written = 0
	}
	if safe > 0 && (safe > st.recordedLSN || seqsChanged(st.recordedSeqs, st.tr.safeSeqs)) {
		// Recorded before the slot is told: a start after this
		// confirmation finds every sequence it covers, and a slot
		// confirmed past the record is not the capture's (planSlot).
		if st.s.recordSeqs(safe, st.tr.safeSeqs) {
			st.recordedSeqs = append(st.recordedSeqs[:0], st.tr.safeSeqs...)
			st.recordedLSN = safe
		}
	}
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), st.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: pglogrepl.LSN(written),
		WALFlushPosition: pglogrepl.LSN(safe),
		WALApplyPosition: pglogrepl.LSN(safe),
		ClientTime:       now,
	})
	if err != nil {
		return fmt.Errorf("send standby status: %w", err)
	}
	st.written, st.flushed, st.lastSt = written, safe, now
	st.tr.sent(safe)
	if safe > 0 {
		st.s.setConfirmed(safe)
	}
	return nil
}

// finish is the first step of the soft stop: it waits until every
// in-flight publish is acknowledged. Service.softStop then confirms what
// is safe to the slot.
func (st *streamer) finish(ctx context.Context) error {
	if err := st.tr.drain(ctx, st.now); err != nil {
		return err
	}
	return nil
}

func quoteIdent(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}

// typeIdent quotes an identifier only when needed, like format_type.
func typeIdent(s string) string {
	if s == "" {
		return quoteIdent(s)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c == '_' || i > 0 && (c >= '0' && c <= '9' || c == '$')) {
			return quoteIdent(s)
		}
	}
	return s
}
