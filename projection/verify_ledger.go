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

// absentSums answers chooseCandidates about the seqs of a digest v2
// transaction that have no candidate: the ledger's body hash, looked up
// once. A nil *absentSums (digest v1) knows none.
type absentSums struct {
	lookup func(seq int) (*[sha256.Size]byte, error)
	sums   map[int]*[sha256.Size]byte // nil value: no entry
}

// choices is how many ways seq s can be filled: its candidates, or 1 when
// it has none and the ledger accounts for it.
func (a *absentSums) choices(bySeq map[int][]*item, s int) (int, error) {
	if n := len(bySeq[s]); n > 0 || a == nil {
		return n, nil
	}
	sum, ok := a.sums[s]
	if !ok {
		var err error
		if sum, err = a.lookup(s); err != nil {
			return 0, err
		}
		a.sums[s] = sum
	}
	if sum == nil {
		return 0, nil
	}
	return 1, nil
}

// hash makes d the digest of the choice pick (one candidate per seq,
// len(pick) seqs), the ledger's hash standing for an absent seq.
func (a *absentSums) hash(d *event.Digest, bySeq map[int][]*item, pick []int) {
	d.Reset()
	for s := range pick {
		if len(bySeq[s]) == 0 {
			_ = d.AddBodyHash(*a.sums[s]) // only reached for v2, where it cannot fail
			continue
		}
		it := bySeq[s][pick[s]]
		d.Add(partSeqOf(it), it.data)
	}
}

// chosenSet is the choice pick's messages with their copies, and how many
// of its seqs are absent (accounted for by the ledger).
func chosenSet(bySeq map[int][]*item, copies map[*item][]*item, pick []int) (map[*item]bool, int) {
	out, nAbsent := make(map[*item]bool, len(pick)), 0
	for s := range pick {
		if len(bySeq[s]) == 0 {
			nAbsent++
			continue
		}
		c := bySeq[s][pick[s]]
		out[c] = true
		for _, cp := range copies[c] {
			out[cp] = true
		}
	}
	return out, nAbsent
}
