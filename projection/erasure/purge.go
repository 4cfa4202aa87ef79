package erasure

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// ErrStreamDeniesDeletes: the stream (deny_delete) or the credentials
// refuse message deletes; --purge-stream cannot be done.
var ErrStreamDeniesDeletes = errors.New("the stream refuses message deletes")

// CheckStreamDeletes fails with ErrStreamDeniesDeletes when the source's
// stream is configured to deny deletes.
func CheckStreamDeletes(ctx context.Context, js jetstream.JetStream, source string) error {
	stream, err := js.Stream(ctx, event.StreamName(source))
	if err != nil {
		return fmt.Errorf("open stream %s: %w", event.StreamName(source), err)
	}
	if stream.CachedInfo().Config.DenyDelete {
		return fmt.Errorf("%w: stream %s has deny_delete set (nothing was erased)", ErrStreamDeniesDeletes, event.StreamName(source))
	}
	return nil
}

// purgeProbeTimeout bounds each of CheckPurge's requests. A request the
// credentials may not make gets no answer (the server refuses it to the
// connection, not to the request), so a refusal shows as this timeout.
const purgeProbeTimeout = 5 * time.Second

// CheckPurge checks, before anything is erased, that PurgeStream can be
// done with js's credentials: the stream allows deletes (else
// ErrStreamDeniesDeletes), the erasure ledger opens (it is created when
// missing: an empty ledger records nothing) and the server answers a
// delete request on the stream and, when it exists, the row object store's
// stream (of sequence 0, which holds no message: "no message found" is the
// answer of a role that may delete). A role that may not (the projector's)
// fails here with ErrStreamDeniesDeletes, instead of after the archive's
// rows were erased.
func CheckPurge(ctx context.Context, js jetstream.JetStream, source string) error {
	if err := CheckStreamDeletes(ctx, js, source); err != nil {
		return err
	}
	refused := func(what string, err error) error {
		return fmt.Errorf("%w: the credentials may not %s (erase --purge-stream needs the erase role; nothing was erased): %w",
			ErrStreamDeniesDeletes, what, err)
	}
	pctx, cancel := context.WithTimeout(ctx, purgeProbeTimeout)
	defer cancel()
	if _, err := OpenLedger(pctx, js, source, true); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return refused("create the erasure ledger "+event.ErasedBucket(source), err)
	}
	streams := []string{event.StreamName(source)}
	if _, err := js.Stream(pctx, "OBJ_"+event.RowBucket(source)); err == nil {
		streams = append(streams, "OBJ_"+event.RowBucket(source))
	}
	for _, name := range streams {
		stream, err := js.Stream(pctx, name)
		if err != nil {
			return fmt.Errorf("open stream %s: %w", name, err)
		}
		err = stream.SecureDeleteMsg(pctx, 0)
		if err == nil || errors.Is(err, jetstream.ErrMsgDeleteUnsuccessful) {
			continue // answered ("no message found"): the request was allowed
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return refused("delete messages of "+name, err)
	}
	return nil
}

// PurgeStream securely deletes (JetStream's secure delete: the message is
// overwritten on disk) from the source's stream every delete event of a
// row erasure id covers (its fence, the rows it erased, and with children
// their children in the same transaction), with the objects of large rows
// (their meta and chunk messages in the object store's stream), then reads
// back to check they are gone and records the counts on the receipt.
// Idempotent: a second run finds nothing.
func PurgeStream(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, source string, id int64) (Receipt, error) {
	if err := CheckStreamDeletes(ctx, js, source); err != nil {
		return Receipt{}, err
	}
	fs := &FenceSet{}
	var table string
	var fc fence
	err := pool.QueryRow(ctx, `SELECT schema_name || '.' || table_name, mode, columns, digest, with_children, (SELECT key FROM epitaph.erasure_secret)
		FROM epitaph.erasures WHERE id = $1`, id).Scan(&table, &fc.mode, &fc.columns, &fc.digest, &fc.withChildren, &fs.key)
	if err != nil {
		return Receipt{}, fmt.Errorf("read erasure %d: %w", id, err)
	}
	fs.byTable = map[string][]fence{table: {fc}}
	fs.rows = map[rowIdentity]bool{}
	rows, err := pool.Query(ctx, `SELECT source, commit_lsn::text, seq FROM epitaph.erased_rows WHERE erasure_id = $1`, id)
	if err != nil {
		return Receipt{}, fmt.Errorf("read erased rows: %w", err)
	}
	var r rowIdentity
	var lsn string
	if _, err := pgx.ForEachRow(rows, []any{&r.source, &lsn, &r.seq}, func() error {
		l, err := event.ParseLSN(lsn)
		r.lsn = l
		fs.rows[r] = true
		return err
	}); err != nil {
		return Receipt{}, fmt.Errorf("read erased rows: %w", err)
	}
	seqs, entries, objects, err := matchingMessages(ctx, js, source, fs)
	if err != nil {
		return Receipt{}, err
	}
	stream, err := js.Stream(ctx, event.StreamName(source))
	if err != nil {
		return Receipt{}, fmt.Errorf("open stream %s: %w", event.StreamName(source), err)
	}
	var ledger jetstream.KeyValue
	if len(seqs) > 0 {
		if ledger, err = OpenLedger(ctx, js, source, true); err != nil {
			return Receipt{}, err
		}
	}
	for i, seq := range seqs {
		// Recorded first: a target that reads the transaction after the
		// delete verifies it with the ledger's hash standing for this
		// message; a delete without its entry would cost the
		// transaction's other rows.
		if err := RecordErased(ctx, ledger, entries[i]); err != nil {
			return Receipt{}, err
		}
		if err := stream.SecureDeleteMsg(ctx, seq); !gone(err) {
			return Receipt{}, deleteRefused(event.StreamName(source), err)
		}
	}
	nobj := 0
	for _, ref := range objects {
		n, err := purgeObject(ctx, js, ref)
		if err != nil {
			return Receipt{}, err
		}
		nobj += n
	}
	// Read back.
	for _, seq := range seqs {
		if _, err := stream.GetMsg(ctx, seq); !errors.Is(err, jetstream.ErrMsgNotFound) {
			return Receipt{}, fmt.Errorf("stream message %d still readable after its secure delete (%v)", seq, err)
		}
	}
	b, err := json.Marshal(map[string]int{"stream:" + event.StreamName(source): len(seqs), "objects": nobj})
	if err != nil {
		return Receipt{}, err
	}
	if _, err := pool.Exec(ctx, `UPDATE epitaph.erasures SET removed = removed || (SELECT jsonb_object_agg(k, COALESCE((removed->>k)::int, 0) + v::int)
		FROM jsonb_each_text($2::jsonb) AS x(k, v)), purge_stream = true, updated_at = now() WHERE id = $1`, id, string(b)); err != nil {
		return Receipt{}, fmt.Errorf("record stream purge: %w", err)
	}
	return GetErasure(ctx, pool, id)
}

// gone reports whether a delete's answer leaves the message gone: deleted
// now, or already (another purge of the same erasure ran at the same time:
// the server answers "no message found", which nats.go wraps as
// ErrMsgDeleteUnsuccessful with the server's text). The read-back checks
// either way.
func gone(err error) bool {
	return err == nil || errors.Is(err, jetstream.ErrMsgNotFound) ||
		(errors.Is(err, jetstream.ErrMsgDeleteUnsuccessful) && strings.Contains(err.Error(), "no message found"))
}

func deleteRefused(stream string, err error) error {
	if strings.Contains(strings.ToLower(err.Error()), "permission") || errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) {
		return fmt.Errorf("%w: %s: the credentials may not delete messages (allow $JS.API.STREAM.MSG.DELETE.%s): %w", ErrStreamDeniesDeletes, stream, stream, err)
	}
	return fmt.Errorf("securely delete from %s: %w", stream, err)
}

// matchingMessages reads every delete event of the source's stream and
// returns the sequences of those fs fences, their erasure ledger entries
// (one per sequence) and the objects they point at.
func matchingMessages(ctx context.Context, js jetstream.JetStream, source string, fs *FenceSet) ([]uint64, []LedgerEntry, []*event.ObjectRef, error) {
	stream, err := js.Stream(ctx, event.StreamName(source))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("open stream %s: %w", event.StreamName(source), err)
	}
	last := stream.CachedInfo().State.LastSeq
	if last == 0 {
		return nil, nil, nil, nil
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{event.SubjectPrefix + "." + source + ".*.delete.>"}})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("read stream %s: %w", event.StreamName(source), err)
	}
	var seqs []uint64
	var entries []LedgerEntry
	var objects []*event.ObjectRef
	parents := map[event.LSN][]ErasedWith{}
	for {
		batch, cancel, err := fetchBatch(ctx, cons, 500)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("read stream %s: %w", event.StreamName(source), err)
		}
		n := 0
		var seen uint64
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				continue
			}
			seen = md.Sequence.Stream
			e, err := event.Decode(m.Data())
			if err != nil || e.Op != event.OpDelete {
				continue
			}
			ar := streamRow{e}
			fenced, children := fs.fenced(ar)
			if !fenced && children == 0 {
				// A child of a row erased in another page, or in this read.
				children = max(fs.childOfErased(ar), referencesAny(ar, parents[e.CommitLSN]))
			}
			if !fenced && children == 0 {
				continue
			}
			seqs = append(seqs, seen)
			entries = append(entries, ledgerEntry(source, seen, e, m.Data()))
			if e.RowRef != nil {
				objects = append(objects, e.RowRef)
			}
			if children != 0 {
				parents[e.CommitLSN] = append(parents[e.CommitLSN], ErasedWith{ar, children})
			}
		}
		cancel()
		if err := batch.Error(); err != nil && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
			return nil, nil, nil, fmt.Errorf("read stream %s: %w", event.StreamName(source), err)
		}
		if n == 0 || seen >= last {
			return seqs, entries, objects, nil
		}
	}
}

// purgeObject securely deletes an object's chunks and meta message from
// the object store's stream and checks it is gone.
func purgeObject(ctx context.Context, js jetstream.JetStream, ref *event.ObjectRef) (int, error) {
	obs, err := js.ObjectStore(ctx, ref.Bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("open object bucket %s: %w", ref.Bucket, err)
	}
	info, err := obs.GetInfo(ctx, ref.Name)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("object %s/%s: %w", ref.Bucket, ref.Name, err)
	}
	stream, err := js.Stream(ctx, "OBJ_"+ref.Bucket)
	if err != nil {
		return 0, fmt.Errorf("object stream of %s: %w", ref.Bucket, err)
	}
	cons, err := stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{fmt.Sprintf("$O.%s.C.%s", ref.Bucket, info.NUID)}})
	if err != nil {
		return 0, fmt.Errorf("read object %s/%s: %w", ref.Bucket, ref.Name, err)
	}
	var seqs []uint64
	for uint32(len(seqs)) < info.Chunks {
		batch, cancel, err := fetchBatch(ctx, cons, 100)
		if err != nil {
			return 0, fmt.Errorf("read object %s/%s: %w", ref.Bucket, ref.Name, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			if md, err := m.Metadata(); err == nil {
				seqs = append(seqs, md.Sequence.Stream)
			}
		}
		cancel()
		if n == 0 {
			break
		}
	}
	meta, err := stream.GetLastMsgForSubject(ctx, fmt.Sprintf("$O.%s.M.%s", ref.Bucket, base64.URLEncoding.EncodeToString([]byte(ref.Name))))
	if err != nil {
		return 0, fmt.Errorf("object %s/%s meta: %w", ref.Bucket, ref.Name, err)
	}
	for _, seq := range append(seqs, meta.Sequence) {
		if err := stream.SecureDeleteMsg(ctx, seq); !gone(err) {
			return 0, deleteRefused("OBJ_"+ref.Bucket, err)
		}
	}
	if _, err := obs.GetInfo(ctx, ref.Name); !errors.Is(err, jetstream.ErrObjectNotFound) {
		return 0, fmt.Errorf("object %s/%s still readable after its secure delete (%v)", ref.Bucket, ref.Name, err)
	}
	return 1, nil
}

// fetchBatch fetches up to n messages, waiting at most 2s; cancel ends the
// fetch's context (call it once the batch is read), so nats.go's fetch
// goroutine never outlives it.
func fetchBatch(ctx context.Context, cons jetstream.Consumer, n int) (jetstream.MessageBatch, context.CancelFunc, error) {
	fctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	batch, err := cons.Fetch(n, jetstream.FetchContext(fctx))
	if err != nil {
		cancel()
		return nil, nil, err
	}
	return batch, cancel, nil
}

// streamRow is a delete event read from the stream, judged by the fences
// with the image it carries.
type streamRow struct{ ev *event.Event }

func (r streamRow) Event() *event.Event    { return r.ev }
func (r streamRow) Image() json.RawMessage { return r.ev.Row }
