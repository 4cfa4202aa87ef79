package handler

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ExitRetry is the exit status with which a command asks to be retried
// (EX_TEMPFAIL); any other non-zero status is a failure.
const ExitRetry = 75

// runner runs one attempt of a handler's kind. It returns nil (done), an
// *Error, or another error (retried).
type runner struct {
	client   *http.Client
	js       jetstream.JetStream
	registry *Registry
	secrets  secretCache
}

func (r *runner) run(ctx context.Context, def Def, d Delivery) error {
	body, err := json.Marshal(d.Body())
	if err != nil {
		return Permanent("encode_body", err)
	}
	switch def.Kind {
	case KindWebhook:
		return r.webhook(ctx, def, d.ID, d.Attempt, 0, body)
	case KindExec:
		return runExec(ctx, def, d, body)
	case KindNATS:
		return r.publish(ctx, def, d, body)
	case KindGo:
		h, ok := r.registry.Lookup(def.Target)
		if !ok {
			return kindError("not_registered", false, "", errors.New("go handler not registered in this process"))
		}
		return h.Handle(ctx, d)
	}
	return kindError("unknown_kind", true, "", fmt.Errorf("unknown handler kind %q", def.Kind))
}

// webhook POSTs body: a delivery's (batch 0), or a batch of n deliveries
// whose message id is id and whose highest attempt is attempt.
func (r *runner) webhook(ctx context.Context, def Def, id string, attempt, batch int, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, def.Target, bytes.NewReader(body))
	if err != nil {
		return kindError("bad_url", true, def.Target, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "epitaph-projector")
	if batch > 0 {
		req.Header.Set(HeaderBatchSize, strconv.Itoa(batch))
	} else {
		req.Header.Set(HeaderDeliveryID, id)
	}
	req.Header.Set(HeaderAttempt, strconv.Itoa(attempt))
	// The body is the same on every attempt; the timestamp (and so the
	// signature) is this attempt's, so a receiver's replay window holds.
	now := time.Now()
	req.Header.Set(HeaderWebhookID, id)
	req.Header.Set(HeaderWebhookTimestamp, unixSeconds(now))
	if def.SecretFile != "" {
		secrets, err := r.secrets.get(def.SecretFile)
		if err != nil {
			return kindError("secret_file", false, def.Target, err)
		}
		if err := signWebhook(req.Header.Set, secrets, id, now, body); err != nil {
			return kindError("sign", false, def.Target, err)
		}
	}
	resp, err := r.client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return kindError("deadline_exceeded", false, def.Target, ctx.Err())
		}
		return kindError("http_transport", false, def.Target, err)
	}
	// The body is never kept or logged: drain a little for keep-alive.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	code := "http_" + strconv.Itoa(resp.StatusCode)
	switch {
	case resp.StatusCode >= 200 && resp.StatusCode < 300:
		return nil
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		return kindError(code, false, def.Target, errors.New("webhook answered "+resp.Status))
	case resp.StatusCode == http.StatusRequestTimeout:
		return kindError(code, false, def.Target, errors.New("webhook answered "+resp.Status))
	default:
		return kindError(code, true, def.Target, errors.New("webhook answered "+resp.Status))
	}
}

// ParseCommand parses an exec handler's target: a JSON array of strings,
// the program first (no shell).
func ParseCommand(target string) ([]string, error) {
	var argv []string
	if err := json.Unmarshal([]byte(target), &argv); err != nil {
		return nil, errors.New(`an exec target is a JSON array of strings, e.g. ["/usr/local/bin/purge", "--quiet"]`)
	}
	if len(argv) == 0 || strings.TrimSpace(argv[0]) == "" {
		return nil, errors.New("an exec target names a program first")
	}
	return argv, nil
}

func runExec(ctx context.Context, def Def, d Delivery, body []byte) error {
	argv, err := ParseCommand(def.Target)
	if err != nil {
		return kindError("bad_command", true, "", err)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Stdin = bytes.NewReader(body)
	// The body is the same on every attempt: the attempt is in the
	// environment, as it is in a webhook's headers.
	cmd.Env = commandEnv(os.Environ(), d)
	// Output is the command's own business: never kept (it may hold data).
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	cmd.WaitDelay = 5 * time.Second
	err = cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil:
		return kindError("deadline_exceeded", false, "", ctx.Err())
	case errors.As(err, &ee):
		code := ee.ExitCode()
		if code == ExitRetry {
			return kindError("exit_75", false, "", err)
		}
		if code < 0 {
			return kindError("signaled", false, "", err)
		}
		return kindError("exit_"+strconv.Itoa(code), true, "", err)
	default:
		// The program could not be started (missing, not executable).
		return kindError("start_failed", false, "", err)
	}
}

// commandEnv is a command's environment: the process's own without its
// settings and secrets, which a command (often a third party's script) has
// no use for: every EPITAPH_* variable (the source, target and NATS URLs
// carry passwords) and every PG* one (libpq's and pgx's connection
// settings, PGPASSWORD among them). PATH, HOME, the locale and the rest
// pass; then the delivery's id and attempt.
func commandEnv(environ []string, d Delivery) []string {
	env := make([]string, 0, len(environ)+2)
	for _, kv := range environ {
		if strings.HasPrefix(kv, "EPITAPH_") || strings.HasPrefix(kv, "PG") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "EPITAPH_DELIVERY_ID="+d.ID, "EPITAPH_ATTEMPT="+strconv.Itoa(d.Attempt))
}

// natsPublishTimeout bounds a nats handler's publish. JetStream answers in
// milliseconds (seconds while a cluster elects a leader); a publish the
// server refuses, for want of permission on the subject, is dropped and
// never answered, and would otherwise hold the delivery in flight until
// its attempt's deadline (90% of the claim timeout).
const natsPublishTimeout = 10 * time.Second

func (r *runner) publish(ctx context.Context, def Def, d Delivery, body []byte) error {
	if r.js == nil {
		return kindError("no_nats", false, "", errors.New("no NATS connection"))
	}
	msg := nats.NewMsg(def.Target)
	msg.Data = body
	msg.Header.Set(jetstream.MsgIDHeader, d.ID)
	msg.Header.Set(HeaderDeliveryID, d.ID)
	msg.Header.Set(HeaderAttempt, strconv.Itoa(d.Attempt))
	before := r.js.Conn().LastError()
	pctx, cancel := context.WithTimeout(ctx, natsPublishTimeout)
	defer cancel()
	if _, err := r.js.PublishMsg(pctx, msg); err != nil {
		if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) {
			return kindError("no_stream", false, "", err)
		}
		if ctx.Err() != nil {
			return kindError("deadline_exceeded", false, "", ctx.Err())
		}
		if pctx.Err() != nil {
			// The server says why it dropped a publish only on the
			// connection: a refusal since this publish began names it.
			if le := r.js.Conn().LastError(); le != nil && le != before && errors.Is(le, nats.ErrPermissionViolation) &&
				strings.Contains(le.Error(), strconv.Quote(def.Target)) {
				return kindError("permission", false, "", fmt.Errorf("the projector's NATS credential may not publish to %s: %w", def.Target, le))
			}
			return kindError("publish_timeout", false, "", fmt.Errorf("JetStream did not answer a publish to %s within %s", def.Target, natsPublishTimeout))
		}
		return kindError("publish", false, "", err)
	}
	return nil
}
