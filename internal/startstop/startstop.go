// Package startstop is the lifecycle every long-lived Epitaph component
// shares, in the manner of River's BaseStartStop:
//
//   - Start(ctx) starts the background work and returns; cancelling ctx
//     later is the hard stop (work in flight is abandoned: transactions roll
//     back, nothing more is acknowledged or confirmed).
//   - Stop(ctx) is the soft stop: the component finishes what it is doing
//     (applies and commits the page, acknowledges, confirms) and returns.
//     When ctx ends first, Stop turns into the hard stop, waits for the
//     component to end and returns an error wrapping ctx's.
//   - Wait() blocks until the component has ended and returns its error
//     (nil after a stop of either kind).
//
// A component embeds or holds a Base, calls StartInit at the top of Start
// and Finish when its background work has ended.
package startstop

import (
	"context"
	"fmt"
	"sync"
)

// Service is the lifecycle contract of a long-lived component.
type Service interface {
	Start(ctx context.Context) error
	Stop(ctx context.Context) error
	Wait() error
}

// Base does the bookkeeping of Service for one component. The zero value
// is ready; a Base is started at most once.
type Base struct {
	mu         sync.Mutex
	started    bool
	soft       context.Context
	softCancel context.CancelFunc
	hardCancel context.CancelFunc
	done       chan struct{}
	finished   bool
	err        error
}

// StartInit begins a start. hard is derived from ctx and is cancelled by
// the hard stop (ctx done, or a Stop whose own context ended first); soft
// is derived from hard and is also cancelled by Stop: a component stops
// taking new work when soft is done and abandons work in flight only when
// hard is. ok is false (and the contexts nil) when the Base was started
// before.
func (b *Base) StartInit(ctx context.Context) (soft, hard context.Context, ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.started {
		return nil, nil, false
	}
	b.started = true
	hard, b.hardCancel = context.WithCancel(ctx)
	b.soft, b.softCancel = context.WithCancel(hard)
	b.done = make(chan struct{})
	return b.soft, hard, true
}

// Finish records the end of the component with err (nil after a stop) and
// releases Stop and Wait. Only the first call counts. A Start that fails
// after StartInit calls it with its error; called before StartInit, it
// ends a component that will never run (Start then fails).
func (b *Base) Finish(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.finished {
		return
	}
	if !b.started {
		b.started = true
		hard, cancel := context.WithCancel(context.Background())
		b.hardCancel = cancel
		b.soft, b.softCancel = context.WithCancel(hard)
		b.done = make(chan struct{})
	}
	b.finished, b.err = true, err
	b.hardCancel()
	close(b.done)
}

// Stopping is closed when a stop (soft or hard) was requested.
func (b *Base) Stopping() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.soft == nil {
		return nil
	}
	return b.soft.Done()
}

// StopRequested reports whether a stop (soft or hard) was requested.
func (b *Base) StopRequested() bool {
	select {
	case <-b.Stopping():
		return true
	default:
		return false
	}
}

// RequestStop asks for the soft stop and returns at once (to ask several
// components before waiting for any: RequestStop each, then Stop each).
// It is a no-op before Start and after the end.
func (b *Base) RequestStop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.softCancel != nil {
		b.softCancel()
	}
}

// Stop is the soft stop bounded by ctx (see the package doc). It returns
// nil at once when the component was never started. Safe to call more
// than once and concurrently.
func (b *Base) Stop(ctx context.Context) error {
	b.mu.Lock()
	if !b.started {
		b.mu.Unlock()
		return nil
	}
	done, hard := b.done, b.hardCancel
	b.softCancel()
	b.mu.Unlock()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
	}
	hard()
	<-done
	return fmt.Errorf("soft stop did not finish in time, stopped hard: %w", context.Cause(ctx))
}

// Wait blocks until the component has ended and returns its error. Before
// Start it returns nil at once.
func (b *Base) Wait() error {
	b.mu.Lock()
	done := b.done
	b.mu.Unlock()
	if done == nil {
		return nil
	}
	<-done
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.err
}

// Done is closed when the component has ended (nil before Start: a
// receive blocks).
func (b *Base) Done() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.done
}
