package projection

import (
	"context"
	"crypto/sha256"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/erasure"
)

// ledgerCache is one page's view of the erasure ledger (erasure.OpenLedger):
// only the slow path of a digest v2 transaction with absent members asks
// it, each (commit LSN, seq) once.
type ledgerCache struct {
	opened bool
	kv     jetstream.KeyValue // nil: no ledger (nothing was ever purged)
	sums   map[ledgerRef]*[sha256.Size]byte
}

type ledgerRef struct {
	lsn event.LSN
	seq int
}

// purgedLookup returns the lookup chooseCandidates asks about an absent
// member of the transaction with commit LSN lsn: the body hash the ledger
// records for it, or nil when it records none (then the member is simply
// missing: a removed_from_stream gap as ever).
func (pv *pageVerifier) purgedLookup(ctx context.Context, lsn event.LSN) func(seq int) (*[sha256.Size]byte, error) {
	return func(seq int) (*[sha256.Size]byte, error) {
		c := pv.ledger
		if c == nil {
			c = &ledgerCache{sums: map[ledgerRef]*[sha256.Size]byte{}}
			pv.ledger = c
		}
		ref := ledgerRef{lsn, seq}
		if sum, ok := c.sums[ref]; ok {
			return sum, nil
		}
		if !c.opened {
			kv, err := erasure.OpenLedger(ctx, pv.w.js, pv.w.cfg.SourceName, false)
			if err != nil {
				return nil, err
			}
			c.kv, c.opened = kv, true
		}
		sum, ok, err := erasure.LookupErased(ctx, c.kv, lsn, seq)
		if err != nil {
			return nil, err
		}
		var out *[sha256.Size]byte
		if ok {
			out = &sum
		}
		c.sums[ref] = out
		return out, nil
	}
}
