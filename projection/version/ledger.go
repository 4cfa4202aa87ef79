package version

import (
	"context"
	"encoding/json"
	"errors"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// maxHeadLedger bounds how many erasure ledger entries a rebuild reads to
// tell whether the stream's removed head was only purged by erasures.
const maxHeadLedger = 100_000

// headErased reports whether every stream sequence 1..toSeq of the
// source's stream is in its erasure ledger (event.ErasedBucket): the head
// was removed by erase --purge-stream only, message by message, and each
// transaction it touched is verified with the ledger's hashes, so nothing
// a reader lacks is missing there. Any doubt (no ledger, an entry that
// does not parse, too many to read) is false: a gap as before.
func headErased(ctx context.Context, js jetstream.JetStream, source string, toSeq uint64) (bool, error) {
	if toSeq > maxHeadLedger {
		return false, nil
	}
	kv, err := js.KeyValue(ctx, event.ErasedBucket(source))
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return false, err
	}
	if st.Values() < toSeq || st.Values() > maxHeadLedger {
		return false, nil
	}
	keys, err := kv.ListKeys(ctx)
	if err != nil {
		return false, err
	}
	defer func() { _ = keys.Stop() }()
	seen := make(map[uint64]bool, toSeq)
	stream := event.StreamName(source)
	for k := range keys.Keys() {
		v, err := kv.Get(ctx, k)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			return false, err
		}
		var e struct {
			Stream    string `json:"stream"`
			StreamSeq uint64 `json:"stream_seq"`
		}
		if json.Unmarshal(v.Value(), &e) != nil {
			return false, nil
		}
		if e.Stream == stream && e.StreamSeq >= 1 && e.StreamSeq <= toSeq {
			seen[e.StreamSeq] = true
		}
	}
	return uint64(len(seen)) == toSeq, nil
}
