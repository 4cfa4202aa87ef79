package erasure

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// The erasure ledger: before erase --purge-stream deletes a message from
// the stream it records the message here, in the KV bucket
// event.ErasedBucket, which every target reading the stream can reach. A
// target that meets a signed transaction with members missing verifies it
// from the bodies it has plus the ledger's body hashes for the missing
// ones (digest v2), so the purge costs none of the transaction's other
// rows. An entry never makes a message believed: it only stands for one
// that is absent.

// LedgerEntry is what the ledger records of one deleted message.
type LedgerEntry struct {
	Stream     string    `json:"stream"`
	StreamSeq  uint64    `json:"stream_seq"`
	CommitLSN  event.LSN `json:"-"`
	LSN        string    `json:"commit_lsn"`
	Seq        int       `json:"seq"`
	BodySHA256 string    `json:"body_sha256"` // hex of event.BodyHash of the message's body
}

// LedgerKey is the ledger's key of the message with commit LSN lsn and
// seq: "<lsn as 16 upper-case hex digits>.<seq>" (a KV key cannot hold
// the '/' of an LSN's text in every client).
func LedgerKey(lsn event.LSN, seq int) string {
	return fmt.Sprintf("%016X.%d", uint64(lsn), seq)
}

// OpenLedger opens the source's erasure ledger, creating it (file storage,
// the stream's replicas) when create and it is missing. Without create, a
// missing bucket is (nil, nil): nothing was ever purged.
func OpenLedger(ctx context.Context, js jetstream.JetStream, source string, create bool) (jetstream.KeyValue, error) {
	name := event.ErasedBucket(source)
	kv, err := js.KeyValue(ctx, name)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("open erasure ledger %s: %w", name, err)
	}
	if !create {
		return nil, nil
	}
	replicas := 1
	if stream, err := js.Stream(ctx, event.StreamName(source)); err == nil {
		replicas = max(1, stream.CachedInfo().Config.Replicas)
	}
	kv, err = js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      name,
		Description: "epitaph erasure ledger: messages erase --purge-stream deleted from " + event.StreamName(source),
		Storage:     jetstream.FileStorage,
		Replicas:    replicas,
		History:     1,
	})
	if err != nil {
		return nil, fmt.Errorf("create erasure ledger %s: %w", name, err)
	}
	return kv, nil
}

// RecordErased puts e in the ledger (before its message is deleted).
func RecordErased(ctx context.Context, kv jetstream.KeyValue, e LedgerEntry) error {
	e.LSN = e.CommitLSN.String()
	b, err := json.Marshal(e)
	if err != nil {
		return err
	}
	if _, err := kv.Put(ctx, LedgerKey(e.CommitLSN, e.Seq), b); err != nil {
		return fmt.Errorf("record stream message %d in the erasure ledger: %w", e.StreamSeq, err)
	}
	return nil
}

// LookupErased returns the body hash the ledger records for the message
// with commit LSN lsn and seq; ok=false when it records none. An entry
// that does not parse, or names another message, counts as none.
func LookupErased(ctx context.Context, kv jetstream.KeyValue, lsn event.LSN, seq int) (sum [sha256.Size]byte, ok bool, err error) {
	if kv == nil {
		return sum, false, nil
	}
	v, err := kv.Get(ctx, LedgerKey(lsn, seq))
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return sum, false, nil
	}
	if err != nil {
		return sum, false, fmt.Errorf("read the erasure ledger: %w", err)
	}
	var e LedgerEntry
	if json.Unmarshal(v.Value(), &e) != nil || e.LSN != lsn.String() || e.Seq != seq {
		return sum, false, nil
	}
	h, err := hex.DecodeString(e.BodySHA256)
	if err != nil || len(h) != sha256.Size {
		return sum, false, nil
	}
	copy(sum[:], h)
	return sum, true, nil
}

// ledgerEntry is the entry of a message read from the stream.
func ledgerEntry(source string, streamSeq uint64, e *event.Event, body []byte) LedgerEntry {
	sum := event.BodyHash(body)
	return LedgerEntry{Stream: event.StreamName(source), StreamSeq: streamSeq, CommitLSN: e.CommitLSN, Seq: e.Seq,
		BodySHA256: hex.EncodeToString(sum[:])}
}
