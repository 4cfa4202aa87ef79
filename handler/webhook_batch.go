package handler

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// MaxBatchSize bounds a webhook handler's batch size.
const MaxBatchSize = 1000

// BatchBody is the JSON of a batch's POST: each delivery's Body, in
// commit order.
type BatchBody struct {
	Deliveries []Body `json:"deliveries"`
}

// BatchID is the webhook-id of a batch of these deliveries (in the order
// sent): a version 8 UUID from sha256 of their ids, so a batch retried
// with the same deliveries has the same id (and the same body).
func BatchID(ids []string) string {
	sum := sha256.Sum256([]byte("epitaph-batch\x00" + strings.Join(ids, "\x00")))
	var b [16]byte
	copy(b[:], sum[:16])
	b[6] = b[6]&0x0f | 0x80
	b[8] = b[8]&0x3f | 0x80
	return formatUUID(b)
}

// batched: c is sent in a batch (its handler batches; a removed handler
// or a scrubbed payload ends it alone).
func (c *claimed) batched() bool {
	return c.def.ID != "" && c.def.Kind == KindWebhook && c.def.BatchSize > 1 && !c.scrubbed
}

// heldBatch is a batched handler's claimed deliveries waiting for their
// batch to fill (or for the handler's batch wait to pass).
type heldBatch struct {
	members []*claimed
	timer   *time.Timer
}

// hold adds c to its handler's batch and returns the batch to run now
// (nil: it waits). The first delivery of a batch starts a timer that
// sends it partial after the handler's BatchWait; that run is outside the
// Parallelism workers (one per batched handler at most at a time).
func (d *Dispatcher) hold(soft, hard context.Context, c *claimed) []*claimed {
	d.heldMu.Lock()
	defer d.heldMu.Unlock()
	if d.held == nil {
		d.held = map[string]*heldBatch{}
	}
	h := c.def.ID
	hb := d.held[h]
	if hb == nil {
		hb = &heldBatch{}
		d.held[h] = hb
		d.heldRuns.Add(1)
		hb.timer = time.AfterFunc(c.def.BatchWait, func() {
			defer d.heldRuns.Done()
			d.heldMu.Lock()
			if d.held[h] != hb {
				d.heldMu.Unlock()
				return // sent full, or handed back at the stop
			}
			delete(d.held, h)
			d.heldMu.Unlock()
			d.runHeld(soft, hard, hb.members)
		})
	}
	hb.members = append(hb.members, c)
	if len(hb.members) < c.def.BatchSize {
		return nil
	}
	delete(d.held, h)
	if hb.timer.Stop() {
		d.heldRuns.Done()
	}
	return hb.members
}

// runHeld sends a batch, or hands it back unstarted once the soft stop
// has begun (as a worker does with what it has not started).
func (d *Dispatcher) runHeld(soft, hard context.Context, cs []*claimed) {
	if soft.Err() != nil {
		for _, c := range cs {
			d.settles <- result{c: c, s: settlement{state: StatePending, handBack: true}}
		}
		return
	}
	for _, r := range d.runWebhookBatch(hard, cs) {
		d.settles <- r
	}
}

// dropHeld hands back every held batch at the stop (after the workers
// ended, before the settler's channel closes) and waits for the batches
// whose timers fired.
func (d *Dispatcher) dropHeld() {
	d.heldMu.Lock()
	var back []*claimed
	for h, hb := range d.held {
		delete(d.held, h)
		if hb.timer.Stop() {
			d.heldRuns.Done()
		}
		back = append(back, hb.members...)
	}
	d.heldMu.Unlock()
	for _, c := range back {
		d.settles <- result{c: c, s: settlement{state: StatePending, handBack: true}}
	}
	d.heldRuns.Wait()
}

// runWebhookBatch runs one attempt of a batch of claimed deliveries of one
// webhook handler: each is revalidated first (one whose verdict is not
// send leaves the batch and ends as alone), then one POST carries the
// rest, in commit order; its answer is each one's. A failed batch is
// retried as a whole: its deliveries get one backoff, so they are due,
// and claimed, together again (each dead at its own max attempts).
func (d *Dispatcher) runWebhookBatch(ctx context.Context, cs []*claimed) []result {
	out := make([]result, 0, len(cs))
	send := make([]*claimed, 0, len(cs))
	decs := make(map[*claimed]Decision, len(cs))
	deadline := cs[0].deadline
	for _, c := range cs {
		if c.deadline.Before(deadline) {
			deadline = c.deadline
		}
	}
	actx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	for _, c := range cs {
		def := c.def
		dec := Decision{Outcome: Send}
		var err error
		switch {
		case def.Revalidate && c.verdict != nil && time.Since(c.verdictAt) <= verdictMaxAge:
			dec, err = c.verdict.Decision, c.verdict.Err
		case def.Revalidate:
			d.met.alone.WithLabelValues(def.ID).Inc()
			dec, err = d.cfg.Revalidate(actx, c.d)
		}
		var s settlement
		switch {
		case err != nil:
			s = d.failure(c, err)
		case dec.Outcome == Send:
			send = append(send, c)
			decs[c] = dec
			continue
		case dec.Outcome == Defer:
			s = settlement{state: StatePending, outcome: string(Defer), delay: def.Backoff, deferred: true}
		case dec.Outcome == StopCompleted || dec.Outcome == StopChanged || dec.Outcome == StopRevoked || dec.Outcome == StopSuperseded:
			s = settlement{state: StateStopped, outcome: string(dec.Outcome)}
		default:
			s = d.failure(c, Permanent("bad_decision", nil))
		}
		s.fingerprint, s.evaluated = dec.Fingerprint, def.Revalidate
		out = append(out, result{c: c, s: s})
	}
	if len(send) == 0 {
		return out
	}
	slices.SortStableFunc(send, func(a, b *claimed) int {
		la, lb := parseLSN(a.d.CommitLSN), parseLSN(b.d.CommitLSN)
		switch {
		case la != lb:
			return cmpU(la, lb)
		case a.d.Seq != b.d.Seq:
			return a.d.Seq - b.d.Seq
		}
		return strings.Compare(a.d.ID, b.d.ID)
	})
	def := send[0].def
	body := BatchBody{Deliveries: make([]Body, len(send))}
	ids := make([]string, len(send))
	attempt := 0
	for i, c := range send {
		body.Deliveries[i], ids[i] = c.d.Body(), c.d.ID
		attempt = max(attempt, c.d.Attempt)
	}
	start := time.Now()
	b, err := json.Marshal(body)
	if err == nil {
		err = d.run.webhook(actx, def, BatchID(ids), attempt, len(send), b)
	} else {
		err = Permanent("encode_body", err)
	}
	delay := Backoff(def.Backoff, attempt)
	for _, c := range send {
		s := settlement{state: StateDone, outcome: OutcomeDone}
		if err != nil {
			s = d.failure(c, err)
			if s.state == StatePending {
				s.delay = delay
			}
		}
		d.met.observe(def, s.outcome, time.Since(start))
		s.fingerprint, s.evaluated = decs[c].Fingerprint, def.Revalidate
		out = append(out, result{c: c, s: s})
	}
	return out
}

// groupBatches splits Flush's claimed deliveries: a batched handler's
// into batches of its size, in claim order (no wait: what Flush claimed is
// what there is), and the others, run one by one.
func (d *Dispatcher) groupBatches(cs []*claimed) (alone []*claimed, batches [][]*claimed) {
	open := map[string][]*claimed{}
	var order []string
	for _, c := range cs {
		if !c.batched() {
			alone = append(alone, c)
			continue
		}
		h := c.def.ID
		if _, ok := open[h]; !ok {
			order = append(order, h)
		}
		open[h] = append(open[h], c)
		if len(open[h]) == c.def.BatchSize {
			batches = append(batches, open[h])
			open[h] = []*claimed{}
		}
	}
	for _, h := range order {
		if len(open[h]) > 0 {
			batches = append(batches, open[h])
		}
	}
	return alone, batches
}

// parseLSN reads "X/Y" (hex); 0 for anything else.
func parseLSN(s string) uint64 {
	hi, lo, ok := strings.Cut(s, "/")
	if !ok {
		return 0
	}
	h, err1 := strconv.ParseUint(hi, 16, 32)
	l, err2 := strconv.ParseUint(lo, 16, 32)
	if err1 != nil || err2 != nil {
		return 0
	}
	return h<<32 | l
}

func cmpU(a, b uint64) int {
	if a < b {
		return -1
	}
	return 1
}

// heldState is the Dispatcher's part for held batches (see hold).
type heldState struct {
	heldMu   sync.Mutex
	held     map[string]*heldBatch
	heldRuns sync.WaitGroup
}
