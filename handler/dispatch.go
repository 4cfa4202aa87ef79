package handler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/internal/startstop"
)

// Defaults of Config.
const (
	DefaultParallelism        = 4
	DefaultPoll               = 500 * time.Millisecond
	DefaultGroupSettleTimeout = 10 * time.Minute
	DefaultPayloadRetention   = 30 * 24 * time.Hour
)

// Config configures a Dispatcher.
type Config struct {
	// Parallelism bounds the attempts run at once (default 4).
	Parallelism int
	// Poll is how often due work is looked for when none was found.
	Poll time.Duration
	// GroupSettleTimeout releases after-group deliveries whose source
	// transaction's commit never arrived, marked released_unsettled; only
	// rows of unsigned (legacy) streams: an unverified row's delivery is
	// never released without its commit.
	GroupSettleTimeout time.Duration
	// PayloadRetention is the backstop scrub: payloads older than it are
	// set to NULL, and queued work whose payload went dead-letters.
	PayloadRetention time.Duration
	// Registry holds the Go handlers of this process (kind "go").
	Registry *Registry
	// Revalidate decides before every attempt (default AlwaysSend); only
	// for handlers with revalidate on.
	Revalidate Revalidator
	// RevalidateBatch, when set, decides for each claimed batch at once,
	// right after the claim; an attempt whose verdict is older than
	// verdictMaxAge when it starts asks Revalidate again.
	RevalidateBatch BatchRevalidator
	// JetStream publishes for nats handlers; without it their deliveries
	// are left for a dispatcher that has one.
	JetStream jetstream.JetStream
	// HTTPClient calls webhooks (default: a client without a timeout of
	// its own; the attempt's context bounds it).
	HTTPClient *http.Client
	Logger     *slog.Logger
	// Registerer gets the dispatcher's metrics (nil: none).
	Registerer prometheus.Registerer
	// Source is the source name whose archived rows cursor handlers
	// deliver (default "main").
	Source string
}

// Dispatcher claims due deliveries and runs them (a startstop service).
type Dispatcher struct {
	pool *pgxpool.Pool
	cfg  Config
	run  runner
	log  *slog.Logger
	met  *metrics

	ss startstop.Base
	// queue holds claimed deliveries waiting for one of the Parallelism
	// workers: the claim loop keeps it fed (claims ahead while handlers
	// run), so a worker never waits for a claim query.
	queue chan *claimed
	// evaluating: the claimed batch being revalidated before it joins the
	// queue (one at a time; only the claim loop starts one); inEval: its
	// size, counted against the queue's room.
	evaluating sync.WaitGroup
	inEval     atomic.Int64
	// depth: the last room, whose half wakes the claim loop (a queue kept
	// twice as deep is topped up when half of that is left, not a
	// quarter).
	depth atomic.Int64
	// taken: deliveries the workers took from the queue; rate, rateAt,
	// rateTaken and lastRevalidated (did the last claimed batch
	// revalidate?) are the claim loop's own (room).
	taken           atomic.Int64
	rate            float64
	rateAt          time.Time
	rateTaken       int64
	lastRevalidated bool
	// batchRoom: what the last claim's batching handlers fill (the claim
	// loop's own; see batchRoomFor).
	batchRoom int
	// settles collects attempts' results; one writer records them in
	// batches (one transaction per batch).
	settles chan result
	wake    chan struct{}

	mu        sync.Mutex
	lastMaint time.Time
	lastScrub time.Time
	// lastBackstop: the payload backstop's last run (hourly).
	lastBackstop time.Time
	defCache     map[string]Def
	defAt        time.Time
	// noAnalyze: tables this role may not analyze; analyzing: a run of
	// analyzeGrown is going (stats.go).
	noAnalyze map[string]bool
	analyzing atomic.Bool
	// claimIdle: the claim loop's last claim found nothing and nothing
	// claimed waits for a worker (Archived wakes it only then: a busy loop
	// claims again as its workers drain the queue).
	claimIdle atomic.Bool
	// hook: tests see settle calls (nil in production).
	beforeSettle func(ctx context.Context, id string) error
	// Batched webhook handlers' claimed deliveries waiting for their
	// batch (webhook_batch.go).
	heldState
	// Cursor handlers' loop (cursor.go).
	cursorState
}

// NewDispatcher builds a dispatcher on the target pool.
func NewDispatcher(pool *pgxpool.Pool, cfg Config) (*Dispatcher, error) {
	if pool == nil {
		return nil, errors.New("dispatcher: no target pool")
	}
	if cfg.Parallelism <= 0 {
		cfg.Parallelism = DefaultParallelism
	}
	if cfg.Poll <= 0 {
		cfg.Poll = DefaultPoll
	}
	if cfg.GroupSettleTimeout <= 0 {
		cfg.GroupSettleTimeout = DefaultGroupSettleTimeout
	}
	if cfg.PayloadRetention <= 0 {
		cfg.PayloadRetention = DefaultPayloadRetention
	}
	if cfg.Revalidate == nil {
		cfg.Revalidate = AlwaysSend
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Source == "" {
		cfg.Source = "main"
	}
	if cfg.HTTPClient == nil {
		cfg.HTTPClient = NewHTTPClient(cfg.Parallelism)
	} else {
		// A copy that never follows a redirect (see noRedirect).
		c := *cfg.HTTPClient
		c.CheckRedirect = noRedirect
		cfg.HTTPClient = &c
	}
	d := &Dispatcher{pool: pool, cfg: cfg, log: cfg.Logger,
		run:       runner{client: cfg.HTTPClient, js: cfg.JetStream, registry: cfg.Registry},
		queue:     make(chan *claimed, 2*claimAhead(cfg.Parallelism)+maxBatchRoom),
		settles:   make(chan result, maxSettleBatch),
		wake:      make(chan struct{}, 1),
		noAnalyze: map[string]bool{},
	}
	d.cursorWake, d.curBusy, d.curQuiet, d.curNotBefore = make(chan struct{}, 1), map[string]bool{}, map[string]bool{}, map[string]time.Time{}
	d.depth.Store(int64(claimAhead(cfg.Parallelism)))
	met, err := newMetrics(cfg.Registerer, pool, cfg.Logger)
	if err != nil {
		return nil, err
	}
	d.met = met
	return d, nil
}

// Start runs the dispatcher in the background until Stop or ctx is done
// (the hard stop: attempts in flight are cancelled, their deliveries stay
// in flight until their claims expire).
func (d *Dispatcher) Start(ctx context.Context) error {
	soft, hard, ok := d.ss.StartInit(ctx)
	if !ok {
		return errors.New("dispatcher already started")
	}
	go d.loop(soft, hard)
	return nil
}

// Stop is the soft stop: no more claims; attempts in flight finish and
// settle, unless ctx ends first.
func (d *Dispatcher) Stop(ctx context.Context) error { return d.ss.Stop(ctx) }

// Wait blocks until the dispatcher has stopped.
func (d *Dispatcher) Wait() error { return d.ss.Wait() }

// Wake asks the dispatcher to look for due work now.
func (d *Dispatcher) Wake() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// claimAhead is how many claimed deliveries wait for a worker at most:
// enough that the workers never starve between two claim queries, and
// that one claim query serves many attempts.
func claimAhead(parallelism int) int { return max(16*parallelism, 64) }

// maxSettleBatch bounds the results recorded in one transaction.
const maxSettleBatch = 256

// NewHTTPClient is the webhook client a dispatcher of this parallelism
// builds when Config.HTTPClient is nil (exported for benchmarks that
// measure a bare call with the same transport): one transport whose idle
// connections per host cover every worker (keep-alive reuse; the default
// transport keeps 2), no timeout of its own (the attempt's context bounds
// each call).
func NewHTTPClient(parallelism int) *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns = max(t.MaxIdleConns, 2*parallelism)
	t.MaxIdleConnsPerHost = max(parallelism, 16)
	return &http.Client{Transport: t, CheckRedirect: noRedirect}
}

// noRedirect: a webhook's answer is the answer to its POST. A redirect
// followed would turn the POST into a GET of another URL (301, 302, 303)
// whose 2xx would count as the delivery done, though nothing received it.
func noRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// loop is the dispatcher's claim loop: it keeps the queue of claimed
// deliveries fed for the workers and, on the soft stop, lets them finish
// what was claimed and the settler record it.
func (d *Dispatcher) loop(soft, hard context.Context) {
	var workers, settler sync.WaitGroup
	settler.Add(1)
	go func() { defer settler.Done(); d.settler(hard) }()
	for range d.cfg.Parallelism {
		workers.Add(1)
		go func() {
			defer workers.Done()
			for c := range d.queue {
				d.taken.Add(1)
				if len(d.queue) <= int(d.depth.Load())/2 {
					d.Wake()
				}
				if soft.Err() != nil || c.waitedTooLong() {
					// Claimed but not started: handed back, no attempt spent.
					d.settles <- result{c: c, s: settlement{state: StatePending, handBack: true}}
					continue
				}
				if c.batched() {
					if cs := d.hold(soft, hard, c); cs != nil {
						for _, r := range d.runWebhookBatch(hard, cs) {
							d.settles <- r
						}
					}
					continue
				}
				d.settles <- result{c: c, s: d.decide(hard, c)}
			}
		}()
	}
	var cursors sync.WaitGroup
	cursors.Add(1)
	go func() { defer cursors.Done(); d.cursorLoop(soft, hard) }()
	var stats sync.WaitGroup
	t := time.NewTicker(d.cfg.Poll)
	defer t.Stop()
	for soft.Err() == nil {
		if d.maintainIfDue(soft) {
			d.keepStatistics(soft, &stats)
		}
		n, err := d.claimAhead(soft)
		if err != nil && soft.Err() == nil {
			d.log.Warn("claiming deliveries failed; retrying", "err", err)
		}
		d.claimIdle.Store(n == 0 && err == nil && len(d.queue) == 0 && d.inEval.Load() == 0)
		if n > 0 && len(d.queue) <= int(d.depth.Load())/2 {
			continue // more may be due
		}
		select {
		case <-soft.Done():
		case <-t.C:
		case <-d.wake:
		}
	}
	d.evaluating.Wait() // its batch joins the queue: handed back unstarted
	close(d.queue)
	stats.Wait()
	workers.Wait()
	d.dropHeld() // a partial batch is handed back unstarted
	cursors.Wait()
	close(d.settles)
	settler.Wait()
	d.ss.Finish(nil)
}

// claimStatementTimeout bounds one claim statement (see claimAhead).
const claimStatementTimeout = 30 * time.Second

// claimAhead tops the queue up: when it is at most half full, one claim
// query claims what fills it.
func (d *Dispatcher) claimAhead(ctx context.Context) (int, error) {
	// inEval first: the batch being evaluated joins the queue before
	// inEval drops, so read in this order it is counted once or twice,
	// never not at all.
	inEval := int(d.inEval.Load())
	room := d.room()
	d.depth.Store(int64(room))
	free := room - len(d.queue) - inEval
	if free < (room+1)/2 || ctx.Err() != nil {
		return 0, nil
	}
	// Not cancelled by the soft stop: a claim statement cancelled midway
	// may commit on the server while its rows are lost here, leaving those
	// deliveries in flight until their claims expire (an attempt spent for
	// nothing). Claimed, they reach the queue, and a stopping worker hands
	// them back unstarted. Bounded, so a stop never waits on a hung target.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), claimStatementTimeout)
	defer cancel()
	cs, err := d.claim(cctx, free)
	if err != nil {
		// Claimed without their handlers: left in flight, reclaimed when
		// their claims expire.
		return 0, err
	}
	// The batch is revalidated beside the loop, which meanwhile claims the
	// next one when the room allows: the claim and the evaluation, each a
	// round trip or two, can overlap instead of adding up. One batch
	// evaluates at a time, so the queue keeps the claims' order.
	d.evaluating.Wait()
	d.lastRevalidated = d.revalidates(cs)
	if len(cs) > 0 {
		d.batchRoom = batchRoomFor(cs)
	}
	if !d.lastRevalidated {
		for _, c := range cs {
			d.queue <- c // never blocks: only this loop sends now
		}
		return len(cs), nil
	}
	d.inEval.Store(int64(len(cs)))
	d.evaluating.Add(1)
	go func() {
		defer d.evaluating.Done()
		d.prevalidate(context.WithoutCancel(ctx), cs)
		for _, c := range cs {
			d.queue <- c // never blocks: counted in inEval when claimed
		}
		d.inEval.Store(0)
		d.Wake() // the queue may be due a claim already
	}()
	return len(cs), nil
}

// room is how many claimed deliveries the claim loop keeps ahead of the
// workers (queued or being revalidated): claimAhead, or twice that while
// the batches are revalidated and the workers take twice that in a
// quarter of verdictMaxAge (the rate of the last sample, see takeRate). A
// batch's evaluation is one more batch in flight, whose latency the
// deeper queue covers, and larger batches share their statements (the
// claim, the target's read, the source's, each group's pair) among more
// deliveries; at that rate a verdict still waits at most a quarter of its
// age for a worker. Slower workers keep claimAhead (a deeper queue would
// only age their verdicts).
//
// When the last claim held deliveries of batching webhook handlers, the
// room is at least what fills one batch of each of them (batchRoomFor):
// the claim is ordered by due time across handlers, so a claim of
// claimAhead split among several handlers filled none of their batches,
// which went out partial at their batch wait, and every claim statement
// and POST served a fraction of the deliveries it could. Batched
// deliveries leave the queue at once for their handler's batch, so the
// deeper queue does not age them.
func (d *Dispatcher) room() int {
	return max(roomFor(claimAhead(d.cfg.Parallelism), d.lastRevalidated, d.takeRate()), d.batchRoom)
}

// maxBatchRoom bounds batchRoomFor (the queue's capacity has room for it
// beside twice claimAhead).
const maxBatchRoom = 2 * MaxBatchSize

// batchRoomFor is the sum of the batch sizes of the batching handlers
// with deliveries in cs (each counted once), at most maxBatchRoom.
func batchRoomFor(cs []*claimed) int {
	n := 0
	var seen map[string]bool
	for _, c := range cs {
		if !c.batched() || seen[c.def.ID] {
			continue
		}
		if seen == nil {
			seen = map[string]bool{}
		}
		seen[c.def.ID] = true
		n += c.def.BatchSize
	}
	return min(n, maxBatchRoom)
}

func roomFor(ahead int, revalidated bool, rate float64) int {
	if revalidated && rate*(verdictMaxAge/4).Seconds() >= float64(2*ahead) {
		return 2 * ahead
	}
	return ahead
}

// takeRate is the deliveries the workers took per second, over the last
// sample of at least rateSample (only the claim loop calls it).
func (d *Dispatcher) takeRate() float64 {
	now, n := time.Now(), d.taken.Load()
	if dt := now.Sub(d.rateAt); dt >= rateSample {
		if !d.rateAt.IsZero() {
			d.rate = float64(n-d.rateTaken) / dt.Seconds()
		}
		d.rateAt, d.rateTaken = now, n
	}
	return d.rate
}

// rateSample is the shortest sample of takeRate.
const rateSample = 200 * time.Millisecond

// settler records results in batches: what arrived while the previous
// batch was written goes into the next one.
func (d *Dispatcher) settler(ctx context.Context) {
	batch := make([]result, 0, maxSettleBatch)
	for r := range d.settles {
		batch = append(batch[:0], r)
	more:
		for len(batch) < maxSettleBatch {
			select {
			case r, ok := <-d.settles:
				if !ok {
					break more
				}
				batch = append(batch, r)
			default:
				break more
			}
		}
		d.settle(ctx, batch)
		d.Wake() // the next deliveries of these rows may be due
	}
}

// Flush runs queued work to completion now: it claims and runs due
// deliveries (waiting out their backoff) until none that this process can
// run is pending and released or in flight, or ctx ends. It returns how
// many such deliveries remain (0 when done). Deliveries waiting for their
// group, of disabled handlers, of Go handlers not in this Registry, or of
// nats handlers without a JetStream, are not waited for.
//
// Cursor handlers go first: their batches are sent without waiting to
// fill, a failed batch's backoff (or another worker's batch in flight) is
// waited out, and their open deliveries (the rows after each enabled
// cursor handler's cursor, up to the horizon or its claimed range) count
// in the number returned.
//
// It claims like the claim loop does (a batch to revalidate together,
// claimAhead deliveries, or when the last claim held deliveries of
// batching handlers at least what fills a batch of each of them) and
// runs Parallelism at once; the next batch is claimed and revalidated
// while the current one's handlers run (one batch ahead at most), so the
// batch's evaluation overlaps the sends instead of preceding them. An
// attempt whose verdict is older than verdictMaxAge when it starts is
// still revalidated alone.
func (d *Dispatcher) Flush(ctx context.Context) (int, error) {
	left, err := d.flushCursors(ctx)
	if err != nil {
		return -1, err
	}
	if left > 0 {
		// ctx ended while cursor batches were open: the queued ones count
		// too (read past ctx, briefly).
		octx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if rows, err := d.open(octx); err == nil {
			left += rows
		}
		return left, nil
	}
	return d.flushRows(ctx)
}

// flushRows is Flush's part for queued deliveries.
func (d *Dispatcher) flushRows(ctx context.Context) (int, error) {
	ahead := claimAhead(d.cfg.Parallelism)
	batchRoom := 0
	cs, err := d.flushClaim(ctx, true, ahead)
	for {
		if err != nil {
			return -1, err
		}
		if len(cs) == 0 {
			left, oerr := d.open(ctx)
			if oerr != nil || left == 0 {
				return left, oerr
			}
			select {
			case <-ctx.Done():
				return left, nil
			case <-time.After(min(d.cfg.Poll, 200*time.Millisecond)):
			}
			cs, err = d.flushClaim(ctx, false, max(ahead, batchRoom))
			continue
		}
		batchRoom = batchRoomFor(cs)
		n := max(ahead, batchRoom)
		claimed := make(chan claimedBatch, 1)
		go func() {
			next, err := d.flushClaim(ctx, false, n)
			claimed <- claimedBatch{cs: next, err: err}
		}()
		d.settle(ctx, d.runBatch(ctx, cs))
		next := <-claimed
		cs, err = next.cs, next.err
		if ctx.Err() != nil && len(cs) > 0 {
			// Claimed ahead but not started: handed back, no attempt spent.
			d.handBack(ctx, cs)
			return -1, ctx.Err()
		}
	}
}

// claimedBatch is a batch claimed ahead by Flush.
type claimedBatch struct {
	cs  []*claimed
	err error
}

// flushClaim is one claim of Flush, of at most n deliveries, with its
// maintenance and the batch's revalidation. The claim is not cancelled by ctx (a claim statement
// cancelled midway may commit on the server while its rows are lost here,
// spending their attempts for nothing); it is bounded like the claim
// loop's.
func (d *Dispatcher) flushClaim(ctx context.Context, first bool, n int) ([]*claimed, error) {
	if err := d.flushMaintain(ctx, first); err != nil {
		return nil, err
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), claimStatementTimeout)
	defer cancel()
	cs, err := d.claim(cctx, n)
	if err != nil {
		return nil, err
	}
	d.prevalidate(ctx, cs)
	return cs, nil
}

// runBatch runs a claimed batch, Parallelism at once, and returns the
// results to record.
func (d *Dispatcher) runBatch(ctx context.Context, cs []*claimed) []result {
	alone, batches := d.groupBatches(cs)
	results := make([]result, len(alone))
	batched := make([][]result, len(batches))
	var wg sync.WaitGroup
	slots := make(chan struct{}, d.cfg.Parallelism)
	for i, c := range alone {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer func() { <-slots; wg.Done() }()
			results[i] = result{c: c, s: d.decide(ctx, c)}
		}()
	}
	for i, b := range batches {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer func() { <-slots; wg.Done() }()
			batched[i] = d.runWebhookBatch(ctx, b)
		}()
	}
	wg.Wait()
	for _, rs := range batched {
		results = append(results, rs...)
	}
	return results
}

// handBack records claimed deliveries that never started as pending again,
// their attempts refunded.
func (d *Dispatcher) handBack(ctx context.Context, cs []*claimed) {
	results := make([]result, len(cs))
	for i, c := range cs {
		results[i] = result{c: c, s: settlement{state: StatePending, handBack: true}}
	}
	d.settle(ctx, results)
}

// flushMaintain is Flush's maintenance and statistics: at the start of
// every Flush, then at most once a second like the claim loop's (run before
// every claim of Parallelism deliveries, its statements cost more than the
// deliveries they preceded).
func (d *Dispatcher) flushMaintain(ctx context.Context, first bool) error {
	d.mu.Lock()
	due := first || time.Since(d.lastMaint) >= time.Second
	d.mu.Unlock()
	if !due {
		return nil
	}
	if err := d.maintain(ctx); err != nil {
		return err
	}
	return d.analyzeGrown(ctx)
}

// open counts the deliveries Flush waits for.
func (d *Dispatcher) open(ctx context.Context) (int, error) {
	var n int
	err := d.pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries d JOIN epitaph.handlers h ON h.id = d.handler_id
		WHERE (d.state = 'in_flight' OR (d.state = 'pending' AND d.released_at IS NOT NULL))
		  AND h.enabled AND h.revoked_at IS NULL AND (h.kind <> 'go' OR h.target = ANY($1)) AND (h.kind <> 'nats' OR $2)`,
		d.cfg.Registry.Names(), d.cfg.JetStream != nil).Scan(&n)
	if err != nil {
		return -1, fmt.Errorf("count open deliveries: %w", err)
	}
	return n, nil
}

// claimed is a claimed delivery with its handler.
type claimed struct {
	d        Delivery
	def      Def
	token    string
	deadline time.Time
	scrubbed bool
	// claimedAt and claim: when it was claimed, for how long.
	claimedAt time.Time
	claim     time.Duration
	// verdict: the batch revalidation's, when it ran (at verdictAt).
	verdict   *Verdict
	verdictAt time.Time
}

// verdictMaxAge bounds how long a batch's verdict stands for an attempt:
// one that waited longer for a worker is revalidated alone when it starts,
// so a decision is never older than this.
const verdictMaxAge = time.Second

// revalidates: does prevalidate have work in cs?
func (d *Dispatcher) revalidates(cs []*claimed) bool {
	if d.cfg.RevalidateBatch == nil {
		return false
	}
	for _, c := range cs {
		if c.revalidates() {
			return true
		}
	}
	return false
}

// revalidates: the batch revalidation decides for c (its handler exists
// and revalidates; a scrubbed payload dead-letters without it).
func (c *claimed) revalidates() bool { return c.def.ID != "" && c.def.Revalidate && !c.scrubbed }

// prevalidate runs the batch revalidation over the claimed deliveries
// whose handler revalidates, bounded by the earliest of their deadlines.
// Verdicts are taken per delivery (a deferred one defers alone).
func (d *Dispatcher) prevalidate(ctx context.Context, cs []*claimed) {
	if d.cfg.RevalidateBatch == nil {
		return
	}
	var batch []*claimed
	var ds []Delivery
	var deadline time.Time
	for _, c := range cs {
		if !c.revalidates() {
			continue
		}
		if deadline.IsZero() || c.deadline.Before(deadline) {
			deadline = c.deadline
		}
		batch, ds = append(batch, c), append(ds, c.d)
	}
	if len(batch) == 0 {
		return
	}
	rctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	vs := d.cfg.RevalidateBatch(rctx, ds)
	now := time.Now()
	for i, c := range batch {
		if i < len(vs) {
			c.verdict, c.verdictAt = &vs[i], now
		}
	}
}

// waitedTooLong: a claimed delivery that waited for a worker more than a
// tenth of its claim (the workers are busy with slow handlers) is handed
// back rather than run on a shortened deadline, or reclaimed unstarted
// (which would spend an attempt without trying).
func (c *claimed) waitedTooLong() bool { return time.Since(c.claimedAt) > c.claim/10 }

const claimSQL = `
WITH due AS (
    SELECT d.ctid AS tid, h.claim_timeout FROM epitaph.deliveries d JOIN epitaph.handlers h ON h.id = d.handler_id
    WHERE d.state = 'pending' AND d.released_at IS NOT NULL AND d.next_attempt_at <= now()
      AND h.enabled AND h.revoked_at IS NULL AND (h.kind <> 'go' OR h.target = ANY($2)) AND (h.kind <> 'nats' OR $3)
      -- A row's handlers run in priority order, each after the previous
      -- one is terminal.
      AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries e
                      WHERE e.source = d.source AND e.commit_lsn = d.commit_lsn AND e.seq = d.seq AND e.id <> d.id
                        AND e.state IN ('pending', 'in_flight') AND (e.priority, e.handler_id) < (d.priority, d.handler_id))
      -- A batching handler sends a key's deliveries in commit order, each
      -- after the previous one is terminal: never two in one batch, nor
      -- a later one while an earlier one waits for its retry.
      AND (h.batch_size <= 1 OR NOT EXISTS (
              SELECT 1 FROM epitaph.deliveries k
              WHERE k.handler_id = d.handler_id AND k.schema_name = d.schema_name AND k.table_name = d.table_name
                AND jsonb_hash(k.key) = jsonb_hash(d.key) AND k.key = d.key AND k.id <> d.id AND k.state IN ('pending', 'in_flight')
                AND (k.commit_lsn, k.seq, k.generation) < (d.commit_lsn, d.seq, d.generation)))
    ORDER BY d.next_attempt_at
    LIMIT $1
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE epitaph.deliveries d SET state = 'in_flight', attempt = d.attempt + 1, claim_token = gen_random_uuid(),
       claim_expires_at = now() + due.claim_timeout, updated_at = now()
-- By the locked row's tid: the claimed row is read where the due scan
-- found it, not looked up again by its primary key.
FROM due WHERE d.ctid = due.tid
RETURNING d.id::text, d.handler_id::text, d.source, d.commit_lsn::text, d.seq, d.generation, d.schema_name, d.table_name,
          d.key, d.payload, d.correlation_id, d.commit_time, d.version, d.phase, d.attempt, d.defers, d.fingerprint,
          d.group_rows, d.group_max, d.payload_scrubbed_at IS NOT NULL, d.claim_token::text,
          (extract(epoch FROM due.claim_timeout) * 1000)::bigint`

// claimPlan pins the claim's plan to the due index's order (set for the
// claim's transaction only). A deliveries table that grew faster than
// autovacuum analyzes it (any backlog: the apply queues thousands a
// second) had the planner, trusting estimates of a few rows, fetch every
// due delivery per handler by bitmap, sort them all and check the priority
// order of each, for every claim: 60-200 ms per claim of 32 on a 30k-row
// backlog, growing with it, where walking the index in order stops after
// the rows it claims (pg auto_explain, bench-handlers).
//
// JIT is off for it too: on a backlog whose statistics are fresh the
// planner's estimate of the claim (a nested loop over every due delivery
// with two subplans each) passes jit_above_cost, and compiling the plan
// took 36-45 ms of every claim, where running it took 3 ms for 64 rows
// (EXPLAIN ANALYZE on 20,000 due deliveries).
var claimPlan = []string{`SET LOCAL enable_bitmapscan = off`, `SET LOCAL enable_sort = off`, `SET LOCAL jit = off`}

func (d *Dispatcher) claim(ctx context.Context, n int) ([]*claimed, error) {
	// One round trip: the claim in a transaction of its own with its plan
	// settings.
	var b pgx.Batch
	b.Queue(`BEGIN`)
	for _, q := range claimPlan {
		b.Queue(q)
	}
	b.Queue(claimSQL, n, d.cfg.Registry.Names(), d.cfg.JetStream != nil)
	b.Queue(`COMMIT`)
	br := d.pool.SendBatch(ctx, &b)
	defer br.Close()
	for range 1 + len(claimPlan) {
		if _, err := br.Exec(); err != nil {
			return nil, fmt.Errorf("claim deliveries: %w", err)
		}
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	now := time.Now()
	cs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*claimed, error) {
		c := &claimed{}
		var payload []byte
		var claimMS int64
		err := r.Scan(&c.d.ID, &c.d.HandlerID, &c.d.Source, &c.d.CommitLSN, &c.d.Seq, &c.d.Generation, &c.d.Schema,
			&c.d.Table, &c.d.Key, &payload, &c.d.CorrelationID, &c.d.CommitTime, &c.d.Version, &c.d.Phase, &c.d.Attempt,
			&c.d.Defers, &c.d.Fingerprint, &c.d.GroupRows, &c.d.GroupMax, &c.scrubbed, &c.token, &claimMS)
		if err != nil {
			return c, err
		}
		// The handler must finish within nine tenths of its claim: the
		// rest covers claim latency and clock skew.
		c.claimedAt, c.claim = now, time.Duration(claimMS)*time.Millisecond
		c.deadline = now.Add(c.claim * 9 / 10)
		if len(payload) > 0 {
			var p storedPayload
			if json.Unmarshal(payload, &p) == nil {
				c.d.Columns, c.d.Group = p.Columns, p.Group
				if len(p.Key) > 0 {
					c.d.Key = p.Key
				}
			}
		} else {
			c.scrubbed = true
		}
		return c, nil
	})
	if err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	if _, err := br.Exec(); err != nil {
		// Not committed (or not known to be): rolled back, or left in
		// flight until the claims expire.
		return nil, fmt.Errorf("claim deliveries: commit: %w", err)
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("claim deliveries: %w", err)
	}
	if len(cs) == 0 {
		return nil, nil
	}
	byID, err := d.defs(ctx, cs)
	if err != nil {
		return cs, err // claimed: they are reclaimed when the claims expire
	}
	for _, c := range cs {
		c.def = byID[c.d.HandlerID]
	}
	return cs, nil
}

// defs returns the handlers by id, cached for a second (reloaded at once
// when a claimed delivery's handler is not in the cache).
func (d *Dispatcher) defs(ctx context.Context, cs []*claimed) (map[string]Def, error) {
	d.mu.Lock()
	byID, fresh := d.defCache, time.Since(d.defAt) < time.Second
	d.mu.Unlock()
	for _, c := range cs {
		if _, ok := byID[c.d.HandlerID]; !ok {
			fresh = false
		}
	}
	if fresh {
		return byID, nil
	}
	list, err := List(ctx, d.pool)
	if err != nil {
		return nil, err
	}
	byID = make(map[string]Def, len(list))
	for _, def := range list {
		byID[def.ID] = def
	}
	d.mu.Lock()
	d.defCache, d.defAt = byID, time.Now()
	d.mu.Unlock()
	return byID, nil
}

// settlement is an attempt's result, written guarded by the claim token.
type settlement struct {
	state, outcome string
	lastError      *string
	delay          time.Duration
	deferred       bool
	fingerprint    string
	evaluated      bool
	// handBack: never started; pending again with the attempt refunded.
	handBack bool
}

// result is a claimed delivery with its attempt's result, to record.
type result struct {
	c *claimed
	s settlement
}

// attempt runs one claimed delivery and records its result at once.
func (d *Dispatcher) attempt(ctx context.Context, c *claimed) {
	d.settle(ctx, []result{{c: c, s: d.decide(ctx, c)}})
}

// decide runs one attempt of a claimed delivery (revalidation first, for
// handlers with it on) and returns what to record.
func (d *Dispatcher) decide(ctx context.Context, c *claimed) settlement {
	def := c.def
	if def.ID == "" { // removed between the claim and now
		return settlement{state: StateStopped, outcome: string(StopCompleted)}
	}
	if c.scrubbed {
		msg := "type=payload_scrubbed code=payload_retention diag=-"
		return settlement{state: StateDead, outcome: OutcomePayloadGone, lastError: &msg}
	}
	actx, cancel := context.WithDeadline(ctx, c.deadline)
	defer cancel()
	start := time.Now()
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
		s = settlement{state: StateDone, outcome: OutcomeDone}
		if err := d.run.run(actx, def, c.d); err != nil {
			s = d.failure(c, err)
		}
		d.met.observe(def, s.outcome, time.Since(start))
	case dec.Outcome == Defer:
		s = settlement{state: StatePending, outcome: string(Defer), delay: def.Backoff, deferred: true}
	case dec.Outcome == StopCompleted || dec.Outcome == StopChanged || dec.Outcome == StopRevoked || dec.Outcome == StopSuperseded:
		s = settlement{state: StateStopped, outcome: string(dec.Outcome)}
	default:
		s = d.failure(c, Permanent("bad_decision", fmt.Errorf("revalidation answered %q", dec.Outcome)))
	}
	s.fingerprint, s.evaluated = dec.Fingerprint, def.Revalidate
	return s
}

// failure is a failed attempt: retried with backoff, or dead after the
// handler's max attempts or at a permanent error, with a sanitized
// last_error whose diagnostic id is also in the log line, which carries
// the whole error (logDetail) at the time of the failure.
func (d *Dispatcher) failure(c *claimed, err error) settlement {
	text, diag := sanitized(err)
	var he *Error
	permanent := errors.As(err, &he) && he.Permanent
	s := settlement{state: StatePending, outcome: OutcomeFailed, lastError: &text, delay: Backoff(c.def.Backoff, c.d.Attempt)}
	if permanent || c.d.Attempt >= c.def.MaxAttempts {
		s.state, s.delay = StateDead, 0
	}
	d.log.Warn("delivery attempt failed", "handler", c.d.HandlerID, "delivery", c.d.ID, "attempt", c.d.Attempt,
		"max_attempts", c.def.MaxAttempts, "next_state", s.state, "diag", diag, "error", logDetail(err), "last_error", text)
	if s.state == StateDead {
		d.met.dead.WithLabelValues(c.d.HandlerID).Inc()
	}
	return s
}

// Backoff is the delay before the attempt after the attempt-th one:
// exponential from base (doubling, at most an hour) with ±25% jitter.
func Backoff(base time.Duration, attempt int) time.Duration {
	base = min(base, time.Hour) // at most an hour (±25%), a larger base included
	b := backoff.NewExponentialBackOff(backoff.WithInitialInterval(base), backoff.WithMultiplier(2),
		backoff.WithRandomizationFactor(0.25), backoff.WithMaxInterval(time.Hour), backoff.WithMaxElapsedTime(0))
	delay := base
	for i := 0; i < min(max(attempt, 1), 64); i++ {
		delay = b.NextBackOff()
	}
	return delay
}

// settleSQL records a batch of results, each row guarded by the claim
// token it was given: a delivery whose claim was reclaimed is not in the
// returned ids. The scrub at terminal state is folded in: a delivery that
// ends while no other delivery of its row is open (as this statement sees
// them) has its payload set to NULL by the same row write, so that the
// usual settle writes each delivery once (a separate scrub UPDATE wrote
// every row a second time, with all its index entries). The row's other
// deliveries are read once per settled delivery (o, by the row's identity
// passed in: the unique index's prefix): whether one is open, and whether
// one still holds a payload; the second is returned (others), and only
// then does scrubSettledSQL run (the usual row has one delivery: no second
// statement, where it cost every batch a read of each of its rows again).
// The uuid arrays are passed as text[] and cast by the server: pgx cannot
// encode a []string as a binary uuid[], and its failed first try formats
// the whole array into an error before it falls back to text, on every
// settle (2% of the dispatcher's CPU in bench-revalidate's profile).
const settleSQL = `
UPDATE epitaph.deliveries d SET state = u.state, outcome = COALESCE(NULLIF(u.outcome, ''), d.outcome),
       last_error = COALESCE(u.last_error, d.last_error),
       next_attempt_at = CASE WHEN u.refund = 1 AND u.deferred = 0 THEN d.next_attempt_at
                              ELSE now() + u.delay_ms * interval '1 millisecond' END,
       attempt = d.attempt - u.refund, defers = d.defers + u.deferred,
       claim_token = NULL, claim_expires_at = NULL, updated_at = now(),
       settled_at = CASE WHEN u.state IN ('done', 'stopped', 'dead') THEN now() END,
       observed_fingerprint = COALESCE(NULLIF(u.fingerprint, ''), d.observed_fingerprint),
       evaluated_at = CASE WHEN u.evaluated THEN now() ELSE d.evaluated_at END,
       payload = CASE WHEN u.state IN ('done', 'stopped', 'dead') AND NOT o.open THEN NULL ELSE d.payload END,
       payload_scrubbed_at = CASE WHEN u.state IN ('done', 'stopped', 'dead') AND NOT o.open AND d.payload IS NOT NULL
                                  THEN COALESCE(d.payload_scrubbed_at, now()) ELSE d.payload_scrubbed_at END
FROM unnest($1::text[]::uuid[], $2::text[]::uuid[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::int[], $8::text[], $9::boolean[],
            $10::int[], $11::text[], $12::pg_lsn[], $13::int[])
     AS u(id, token, state, outcome, last_error, delay_ms, deferred, fingerprint, evaluated, refund, source, commit_lsn, seq)
CROSS JOIN LATERAL (
    SELECT COALESCE(bool_or(e.state IN ('pending', 'in_flight')), false) AS open,
           COALESCE(bool_or(e.payload IS NOT NULL), false) AS kept
    FROM epitaph.deliveries e
    WHERE e.source = u.source AND e.commit_lsn = u.commit_lsn AND e.seq = u.seq AND e.id <> u.id) o
WHERE d.id = u.id AND d.claim_token = u.token
RETURNING d.id::text, u.state IN ('done', 'stopped', 'dead') AND o.kept`

// scrubSettledSQL, after settleSQL in the same transaction (it sees its
// results), scrubs what settleSQL could not: the other deliveries of the
// rows whose every delivery is terminal now (the earlier handlers of a
// row, and rows of which two deliveries ended in this batch, each seeing
// the other open). It runs for the deliveries settleSQL returned with
// others (another delivery of the row still held a payload); a stale
// result's row (its claim reclaimed) is left to the settle of its newer
// run.
const scrubSettledSQL = `
UPDATE epitaph.deliveries o SET payload = NULL, payload_scrubbed_at = COALESCE(o.payload_scrubbed_at, now())
FROM (SELECT DISTINCT source, commit_lsn, seq FROM epitaph.deliveries
      WHERE id = ANY($1::text[]::uuid[]) AND state IN ('done', 'stopped', 'dead')) r
WHERE o.source = r.source AND o.commit_lsn = r.commit_lsn AND o.seq = r.seq AND o.payload IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries e WHERE e.source = r.source AND e.commit_lsn = r.commit_lsn
                  AND e.seq = r.seq AND e.state IN ('pending', 'in_flight'))`

// scrubRowSQL scrubs the payloads of a row's deliveries once every handler
// of the row is terminal.
const scrubRowSQL = `
UPDATE epitaph.deliveries SET payload = NULL, payload_scrubbed_at = now()
WHERE source = $1 AND commit_lsn = $2::pg_lsn AND seq = $3 AND payload IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries e WHERE e.source = $1 AND e.commit_lsn = $2::pg_lsn AND e.seq = $3
                  AND e.state IN ('pending', 'in_flight'))`

// settle records a batch of results in one transaction, each guarded by
// its claim token: a run whose claim was reclaimed settles nothing. A
// failure to record leaves the batch's deliveries in flight (their attempts
// spent) until their claims expire.
func (d *Dispatcher) settle(ctx context.Context, batch []result) {
	if len(batch) == 0 {
		return
	}
	var settled map[string]bool
	err := d.settleAgainOnDeadlock(func() (err error) {
		settled, err = d.settleTx(ctx, batch)
		return err
	}, "deliveries", len(batch))
	if err != nil {
		for _, r := range batch {
			d.log.Error("recording a delivery's outcome failed: it stays in flight until its claim expires",
				"handler", r.c.d.HandlerID, "delivery", r.c.d.ID, "attempt", r.c.d.Attempt, "err", err)
		}
		return
	}
	for _, r := range batch {
		if !settled[r.c.d.ID] {
			d.log.Warn("delivery outcome discarded: its claim was reclaimed", "handler", r.c.d.HandlerID,
				"delivery", r.c.d.ID, "attempt", r.c.d.Attempt)
			d.met.stale.Inc()
		}
	}
}

// settleArgs are the columns of settleSQL's unnest.
type settleArgs struct {
	ids, tokens, states, outcomes, fingerprints []string
	lastErrors                                  []*string
	delays                                      []int64
	deferred, refund                            []int32
	evaluated                                   []bool
	// The delivery's row: its other deliveries are read by it.
	sources, lsns []string
	seqs          []int32
}

func (a *settleArgs) add(c *claimed, s settlement) {
	deferred, refund := int32(0), int32(0)
	if s.deferred {
		deferred, refund = 1, 1
	}
	if s.handBack {
		refund = 1
	}
	a.ids = append(a.ids, c.d.ID)
	a.tokens = append(a.tokens, c.token)
	a.states = append(a.states, s.state)
	a.outcomes = append(a.outcomes, s.outcome)
	a.lastErrors = append(a.lastErrors, s.lastError)
	a.delays = append(a.delays, s.delay.Milliseconds())
	a.deferred = append(a.deferred, deferred)
	a.fingerprints = append(a.fingerprints, s.fingerprint)
	a.evaluated = append(a.evaluated, s.evaluated)
	a.refund = append(a.refund, refund)
	a.sources = append(a.sources, c.d.Source)
	a.lsns = append(a.lsns, c.d.CommitLSN)
	a.seqs = append(a.seqs, int32(c.d.Seq))
}

// settleTx writes a batch and returns the ids it settled (the others'
// claims were reclaimed).
func (d *Dispatcher) settleTx(ctx context.Context, batch []result) (map[string]bool, error) {
	ctx = context.WithoutCancel(ctx)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var a settleArgs
	for _, r := range batch {
		if d.beforeSettle != nil {
			if err := d.beforeSettle(ctx, r.c.d.ID); err != nil {
				return nil, err
			}
		}
		a.add(r.c, r.s)
	}
	// One round trip in the usual case: the transaction is begun with the
	// settle, and committed alone, or after scrubSettledSQL when a settled
	// row's other deliveries still hold payloads.
	var b pgx.Batch
	b.Queue(`BEGIN`)
	b.Queue(settleSQL, a.ids, a.tokens, a.states, a.outcomes, a.lastErrors, a.delays, a.deferred, a.fingerprints,
		a.evaluated, a.refund, a.sources, a.lsns, a.seqs)
	settled := make(map[string]bool, len(batch))
	var others []string
	// One connection for the transaction; one left in it by an error is
	// destroyed on release (rolled back), never reused.
	conn, err := d.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("settle %d deliveries: %w", len(batch), err)
	}
	defer conn.Release()
	err = func() error {
		br := conn.SendBatch(ctx, &b)
		defer br.Close()
		if _, err := br.Exec(); err != nil {
			return err
		}
		rows, err := br.Query()
		if err != nil {
			return err
		}
		var id string
		var kept bool
		if _, err := pgx.ForEachRow(rows, []any{&id, &kept}, func() error {
			settled[id] = true
			if kept {
				others = append(others, id)
			}
			return nil
		}); err != nil {
			return err
		}
		return br.Close()
	}()
	if err == nil {
		var c pgx.Batch
		if len(others) > 0 {
			c.Queue(scrubSettledSQL, others)
		}
		c.Queue(`COMMIT`)
		err = conn.SendBatch(ctx, &c).Close()
	}
	if err != nil {
		return nil, fmt.Errorf("settle %d deliveries: %w", len(batch), err)
	}
	return settled, nil
}

// maintainIfDue runs maintain at most once a second; it reports whether
// it was due.
func (d *Dispatcher) maintainIfDue(ctx context.Context) bool {
	d.mu.Lock()
	due := time.Since(d.lastMaint) >= time.Second
	d.mu.Unlock()
	if !due {
		return false
	}
	if err := d.maintain(ctx); err != nil && ctx.Err() == nil {
		d.log.Warn("delivery maintenance failed; retrying", "err", err)
	}
	return true
}

// maintain reclaims expired claims (the reclaim counts as an attempt:
// dead when it was the last), releases unsettled groups past the settle
// timeout (unsigned rows only) and, every minute (and on the first call),
// dead-letters deliveries of unknown handlers; every hour (and on the first
// call) it runs the payload backstop.
func (d *Dispatcher) maintain(ctx context.Context) error {
	d.mu.Lock()
	d.lastMaint = time.Now()
	scrub := time.Since(d.lastScrub) >= time.Minute
	if scrub {
		d.lastScrub = time.Now()
	}
	// Looked at only with the minute's work, so a due backstop is never
	// consumed by a call that returns before running it.
	backstop := scrub && time.Since(d.lastBackstop) >= backstopEvery
	if backstop {
		d.lastBackstop = time.Now()
	}
	d.mu.Unlock()
	n, err := d.endAndScrub(ctx, `UPDATE epitaph.deliveries d SET
		state = CASE WHEN d.attempt >= COALESCE((SELECT h.max_attempts FROM epitaph.handlers h WHERE h.id = d.handler_id), 1)
		             THEN 'dead' ELSE 'pending' END,
		outcome = 'claim_expired', last_error = 'type=claim_expired code=claim_expired diag=-',
		claim_token = NULL, claim_expires_at = NULL, next_attempt_at = now(), updated_at = now(),
		settled_at = CASE WHEN d.attempt >= COALESCE((SELECT h.max_attempts FROM epitaph.handlers h WHERE h.id = d.handler_id), 1)
		                  THEN now() END
		WHERE d.state = 'in_flight' AND d.claim_expires_at < now()
		RETURNING d.state, d.source, d.commit_lsn::text, d.seq`)
	if err != nil {
		return fmt.Errorf("reclaim expired claims: %w", err)
	}
	if n > 0 {
		d.log.Warn("reclaimed deliveries whose claims expired (each counts as an attempt)", "deliveries", n)
		d.met.reclaimed.Add(float64(n))
	}
	if _, err := d.pool.Exec(ctx, `UPDATE epitaph.deliveries SET released_at = now(), released_unsettled = true, updated_at = now()
		WHERE released_at IS NULL AND state = 'pending' AND verified AND created_at < now() - $1 * interval '1 millisecond'`,
		d.cfg.GroupSettleTimeout.Milliseconds()); err != nil {
		return fmt.Errorf("release unsettled groups: %w", err)
	}
	if !scrub {
		return nil
	}
	// Once a minute: this looks at every pending delivery.
	if err := d.deadLetterUnknown(ctx); err != nil {
		return err
	}
	if !backstop {
		return nil
	}
	return d.Backstop(ctx)
}

// backstopEvery: the payload backstop reads every delivery (no index
// covers old payloads: one would be written by every insert and claim),
// so it runs at the first maintenance and then hourly, not every minute
// (two full scans in bench-handlers' 110 s drain, 7% of its Postgres
// time, growing with the table); against a retention of days, an hour
// late at most.
const backstopEvery = time.Hour

// deadLetterUnknown dead-letters the pending deliveries whose handler id
// no handler has.
func (d *Dispatcher) deadLetterUnknown(ctx context.Context) error {
	n, err := d.endAndScrub(ctx, `UPDATE epitaph.deliveries d SET state = 'dead', outcome = 'unknown_handler',
		last_error = 'type=unknown_handler code=unknown_handler diag=-', settled_at = now(), updated_at = now()
		WHERE d.state = 'pending' AND d.released_at IS NOT NULL
		  AND NOT EXISTS (SELECT 1 FROM epitaph.handlers h WHERE h.id = d.handler_id)
		RETURNING d.state, d.source, d.commit_lsn::text, d.seq`)
	if err != nil {
		return fmt.Errorf("dead-letter deliveries of unknown handlers: %w", err)
	}
	if n > 0 {
		d.log.Error("dead-lettered deliveries whose handler id is unknown", "deliveries", n)
	}
	return nil
}

// endAndScrub runs an UPDATE returning (state, source, commit_lsn, seq)
// and scrubs the payloads of the rows it made terminal whose every
// delivery is terminal. It returns how many deliveries it updated.
func (d *Dispatcher) endAndScrub(ctx context.Context, stmt string) (int, error) {
	rows, err := d.pool.Query(ctx, stmt)
	if err != nil {
		return 0, err
	}
	type rowID struct {
		source, lsn string
		seq         int
	}
	var ended []rowID
	n := 0
	for rows.Next() {
		var state string
		var r rowID
		if err := rows.Scan(&state, &r.source, &r.lsn, &r.seq); err != nil {
			rows.Close()
			return n, err
		}
		n++
		if state != StatePending && state != StateInFlight {
			ended = append(ended, r)
		}
	}
	if err := rows.Err(); err != nil {
		return n, err
	}
	for _, r := range ended {
		if _, err := d.pool.Exec(ctx, scrubRowSQL, r.source, r.lsn, r.seq); err != nil {
			return n, fmt.Errorf("scrub payloads: %w", err)
		}
	}
	return n, nil
}

// Backstop scrubs the payloads of deliveries older than the payload
// retention; queued work whose payload it scrubbed is dead at once, naming
// the scrub (it could never complete).
func (d *Dispatcher) Backstop(ctx context.Context) error {
	tag, err := d.pool.Exec(ctx, `UPDATE epitaph.deliveries SET payload = NULL, payload_scrubbed_at = now(), updated_at = now(),
		outcome = CASE WHEN state = 'pending' THEN 'payload_scrubbed' ELSE outcome END,
		last_error = CASE WHEN state = 'pending' THEN 'type=payload_scrubbed code=payload_retention diag=-' ELSE last_error END,
		settled_at = CASE WHEN state = 'pending' THEN now() ELSE settled_at END,
		state = CASE WHEN state = 'pending' THEN 'dead' ELSE state END
		WHERE payload IS NOT NULL AND created_at < now() - $1 * interval '1 millisecond'`, d.cfg.PayloadRetention.Milliseconds())
	if err != nil {
		return fmt.Errorf("scrub old payloads: %w", err)
	}
	if n := tag.RowsAffected(); n > 0 {
		d.log.Info("scrubbed delivery payloads past the retention", "deliveries", n, "retention", d.cfg.PayloadRetention)
	}
	return nil
}
