package testenv

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// Attacker is a client holding one role's real credentials that tries what
// the role may not do. Each attempt must fail, and the server must report
// a permissions violation for the attempt's subject: a refusal, not a
// timeout or a missing stream.
type Attacker struct {
	NC *nats.Conn
	JS jetstream.JetStream

	mu         sync.Mutex
	violations []string
}

// NewAttacker connects to url with the role's options (its credentials).
func NewAttacker(tb testing.TB, url string, opts ...nats.Option) *Attacker {
	tb.Helper()
	a := &Attacker{}
	opts = append(opts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.violations = append(a.violations, err.Error())
	}))
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		tb.Fatalf("attacker: connect: %v", err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatalf("attacker: %v", err)
	}
	a.NC, a.JS = nc, js
	return a
}

// Attempt is one thing a role may not do: Do must fail, and the server
// reports a permissions violation naming a subject with prefix Subject.
type Attempt struct {
	Name    string
	Subject string
	Do      func(ctx context.Context) error
}

func (a *Attacker) refused(subject string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, e := range a.violations {
		if strings.Contains(strings.ToLower(e), "permissions violation") && strings.Contains(e, `"`+subject) {
			return true
		}
	}
	return false
}

// RequireRefused runs the attempts at once (a refused request gets no
// answer, so each waits out a short timeout) and fails the test for any
// that succeeded or that the server did not refuse.
func (a *Attacker) RequireRefused(tb testing.TB, ctx context.Context, attempts []Attempt) {
	tb.Helper()
	errs := make([]error, len(attempts))
	var wg sync.WaitGroup
	for i, at := range attempts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			actx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			errs[i] = at.Do(actx)
		}()
	}
	wg.Wait()
	_ = a.NC.Flush()
	for i, at := range attempts {
		if errs[i] == nil {
			tb.Errorf("attacker: %s (%s) succeeded", at.Name, at.Subject)
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, at := range attempts {
		for !a.refused(at.Subject) {
			if time.Now().After(deadline) {
				tb.Errorf("attacker: no permissions violation reported for %s (%s)", at.Name, at.Subject)
				break
			}
			time.Sleep(20 * time.Millisecond) // the server's -ERR arrives asynchronously
		}
	}
}

// publish is a plain publish (no reply expected): its error is the
// violation the server reports; nil when none came within 10 s (the
// server reports it before it answers the flush, but the client hands it
// to the error handler asynchronously, late on a loaded machine).
func (a *Attacker) publish(ctx context.Context, subject string, hdr nats.Header, data []byte) error {
	if err := a.NC.PublishMsg(&nats.Msg{Subject: subject, Header: hdr, Data: data}); err != nil {
		return err
	}
	return a.awaitRefusal(ctx, "publish to", subject)
}

// awaitRefusal flushes, then waits up to 10 s for the server's permissions
// violation on subject: an error naming what was refused, nil when none
// came.
func (a *Attacker) awaitRefusal(ctx context.Context, what, subject string) error {
	if err := a.NC.FlushWithContext(ctx); err != nil {
		return err
	}
	deadline := time.Now().Add(10 * time.Second)
	for !a.refused(subject) {
		if time.Now().After(deadline) {
			return nil
		}
		time.Sleep(20 * time.Millisecond) // the server's -ERR arrives asynchronously
	}
	return fmt.Errorf("%s %s refused", what, subject)
}

// common are the attempts no running role may make on source's stream:
// removing a message (plain or secure), emptying or deleting the stream,
// pausing or moving a consumer (victim, another target's), listing
// consumers, and touching another source's stream or making a stream.
func (a *Attacker) common(source, victim string, seq uint64) []Attempt {
	name := event.StreamName(source)
	st := func(ctx context.Context) (jetstream.Stream, error) {
		// A handle without the info call (the role may read it or not).
		return a.JS.Stream(ctx, name)
	}
	other := event.StreamName(source + "x")
	return []Attempt{
		a.deleteMsg(name, seq, false),
		a.deleteMsg(name, seq, true),
		{"purge the stream", "$JS.API.STREAM.PURGE." + name, func(ctx context.Context) error {
			s, err := st(ctx)
			if err != nil {
				return err
			}
			return s.Purge(ctx)
		}},
		{"delete the stream", "$JS.API.STREAM.DELETE." + name, func(ctx context.Context) error {
			return a.JS.DeleteStream(ctx, name)
		}},
		{"pause another target's consumer", "$JS.API.CONSUMER.PAUSE." + name + "." + victim, func(ctx context.Context) error {
			_, err := a.JS.PauseConsumer(ctx, name, victim, time.Now().Add(time.Hour))
			return err
		}},
		{"reset another target's consumer past messages", "$JS.API.CONSUMER.RESET." + name + "." + victim, func(ctx context.Context) error {
			_, err := a.JS.ResetConsumerToSequence(ctx, name, victim, seq+1000)
			return err
		}},
		a.ListConsumers(source),
		{"create a stream", "$JS.API.STREAM.CREATE." + other, func(ctx context.Context) error {
			_, err := a.JS.CreateStream(ctx, jetstream.StreamConfig{Name: other, Subjects: []string{"evil.>"}, Storage: jetstream.MemoryStorage})
			return err
		}},
		{"publish to another source", event.CommitSubject(source+"x", 0), func(ctx context.Context) error {
			return a.publish(ctx, event.CommitSubject(source+"x", 0), nil, []byte(`{"v":1,"op":"commit"}`))
		}},
	}
}

// ProjectorAttempts are what a running projector's credentials may not do
// on source's stream: on top of the common ones, allowing roll-ups, publishing a forged commit, writing the
// erasure ledger or an object. victim is another target's consumer, seq a
// stored message's sequence.
func (a *Attacker) ProjectorAttempts(source, victim string, seq uint64) []Attempt {
	name := event.StreamName(source)
	return append(a.common(source, victim, seq),
		Attempt{"allow roll-ups on the stream", "$JS.API.STREAM.UPDATE." + name, func(ctx context.Context) error {
			_, err := a.JS.UpdateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{event.StreamSubjects(source)}, AllowRollup: true})
			return err
		}},
		Attempt{"publish a forged commit", event.CommitSubject(source, 0), func(ctx context.Context) error {
			return a.publish(ctx, event.CommitSubject(source, 0), nats.Header{event.HeaderMsgID: []string{source + "/0/1/commit"}}, []byte(`{"v":1,"op":"commit"}`))
		}},
		Attempt{"write the erasure ledger", "$KV." + event.ErasedBucket(source) + ".", func(ctx context.Context) error {
			return a.publish(ctx, "$KV."+event.ErasedBucket(source)+".forged", nil, []byte(`{}`))
		}},
		Attempt{"write an object", "$O." + event.RowBucket(source) + ".", func(ctx context.Context) error {
			return a.publish(ctx, "$O."+event.RowBucket(source)+".C.forged", nil, []byte(`x`))
		}},
	)
}

// CaptureAttempts are what the capture's credentials may not do: on top
// of the common ones, writing the erasure ledger or creating a consumer
// of it.
func (a *Attacker) CaptureAttempts(source, victim string, seq uint64) []Attempt {
	name := event.StreamName(source)
	out := a.common(source, victim, seq)
	out[0] = a.deleteMsg(name, seq, false)
	ledger := "KV_" + event.ErasedBucket(source)
	return append(out,
		a.deleteMsg(name, seq, true),
		Attempt{"write the erasure ledger", "$KV." + event.ErasedBucket(source) + ".", func(ctx context.Context) error {
			return a.publish(ctx, "$KV."+event.ErasedBucket(source)+".forged", nil, []byte(`{}`))
		}},
		Attempt{"read the erasure ledger's consumers", "$JS.API.CONSUMER.CREATE." + ledger, func(ctx context.Context) error {
			_, err := a.JS.CreateOrUpdateConsumer(ctx, ledger, jetstream.ConsumerConfig{Name: "evil", AckPolicy: jetstream.AckNonePolicy})
			return err
		}},
	)
}

func (a *Attacker) deleteMsg(name string, seq uint64, secure bool) Attempt {
	what := "delete a message"
	if secure {
		what = "securely delete a message"
	}
	return Attempt{what, "$JS.API.STREAM.MSG.DELETE." + name, func(ctx context.Context) error {
		s, err := a.JS.Stream(ctx, name)
		if err != nil {
			return err
		}
		if secure {
			return s.SecureDeleteMsg(ctx, seq)
		}
		return s.DeleteMsg(ctx, seq)
	}}
}

// subscribe subscribes to subject: its error is the violation the server
// reports; nil when none came within 10 s (see publish).
func (a *Attacker) subscribe(ctx context.Context, subject string) error {
	sub, err := a.NC.SubscribeSync(subject)
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }()
	return a.awaitRefusal(ctx, "subscription to", subject)
}

// SnoopAttempts are the subscriptions that would show another client's
// JetStream traffic, whose subjects name its consumers: every inbox, the
// inboxes of victimUser (another target's projector user), the
// acknowledgements and the JetStream advisories of source's stream.
func (a *Attacker) SnoopAttempts(source, victimUser string) []Attempt {
	name := event.StreamName(source)
	var out []Attempt
	for _, s := range []struct{ what, subject string }{
		{"read every client's inbox", "_INBOX.>"},
		{"read another user's inboxes", "_INBOX." + victimUser + ".>"},
		{"read the consumers' acknowledgements", "$JS.ACK." + name + ".>"},
		{"read the consumer advisories", "$JS.EVENT.ADVISORY.CONSUMER.>"},
	} {
		out = append(out, Attempt{s.what, s.subject, func(ctx context.Context) error {
			return a.subscribe(ctx, s.subject)
		}})
	}
	return out
}

// ListConsumers is listing the consumers of source's stream (their names
// are capabilities: no role may).
func (a *Attacker) ListConsumers(source string) Attempt {
	name := event.StreamName(source)
	return Attempt{"list the consumers", "$JS.API.CONSUMER.NAMES." + name, func(ctx context.Context) error {
		s, err := a.JS.Stream(ctx, name)
		if err != nil {
			return err
		}
		l := s.ConsumerNames(ctx)
		for range l.Name() {
		}
		return l.Err()
	}}
}
