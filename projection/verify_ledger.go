package projection

import (
	"context"
	"crypto/sha256"
	"maps"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
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

// chosenSet is the choice pick's messages with their copies, and its
// seqs that are absent (accounted for by the ledger), in order.
func chosenSet(bySeq map[int][]*item, copies map[*item][]*item, pick []int) (map[*item]bool, []int) {
	out := make(map[*item]bool, len(pick))
	var absent []int
	for s := range pick {
		if len(bySeq[s]) == 0 {
			absent = append(absent, s)
			continue
		}
		c := bySeq[s][pick[s]]
		out[c] = true
		for _, cp := range copies[c] {
			out[cp] = true
		}
	}
	return out, absent
}

// purgedRows are the members of commit b's transaction that are absent
// from the stream and accounted for by the ledger (seqs absent), as rows
// the version will never hold: their transaction's snapshot documents do
// not expect them (snapshot.Discount). Each is given a table from what
// the signed commit counts per table less the deletes chosen (present);
// the ledger's own word is not taken for it. When the absent members are
// of several tables, which seq gets which table is arbitrary, but the
// counts per table, all a document's completeness check reads, are exact.
func purgedRows(b *event.Event, chosen map[*item]bool, absent []int) []snapshot.FencedRow {
	if len(absent) == 0 {
		return nil
	}
	left := maps.Clone(b.Tables)
	seen := map[int]bool{}
	for it := range chosen {
		if it.ev.Op == event.OpDelete && !seen[it.ev.Seq] {
			seen[it.ev.Seq] = true
			if n := left[it.ev.QualifiedTable()]; n > 0 {
				left[it.ev.QualifiedTable()] = n - 1
			}
		}
	}
	tables := slices.Sorted(maps.Keys(left))
	out := make([]snapshot.FencedRow, 0, len(absent))
	for _, s := range absent {
		tbl := ""
		for _, t := range tables {
			if left[t] > 0 {
				tbl = t
				left[t]--
				break
			}
		}
		out = append(out, snapshot.FencedRow{CorrelationID: b.CorrelationID(), Source: b.Source, CommitLSN: b.CommitLSN, Seq: s, Table: tbl})
	}
	return out
}

// discountPurged records, in the page's transaction tx, the members of
// verified transactions that were purged from the stream (verdict.purged)
// as rows version v will never hold, so that their transactions' other
// snapshot documents complete without them, as erased and fenced rows
// are (snapshot.Discount: each row counts once however often the
// transaction is verified). Jobs made before (a transaction applied again)
// are due again with the counts they can meet.
func (s *Service) discountPurged(ctx context.Context, tx pgx.Tx, v version.Version, purged []snapshot.FencedRow) error {
	if len(purged) == 0 || s.extraDDL == nil {
		return nil
	}
	n, err := snapshot.Discount(ctx, tx, v.Schema, purged)
	if err != nil || n == 0 {
		return err
	}
	var ids []string
	for _, r := range purged {
		if !slices.Contains(ids, r.CorrelationID) {
			ids = append(ids, r.CorrelationID)
		}
	}
	_, err = snapshot.Invalidate(ctx, tx, v.Schema, ids)
	return err
}
