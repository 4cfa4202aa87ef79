package quarantine

import (
	"context"
	"errors"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
)

// PermanentError marks a failure that retrying the same event with the same
// code will not fix: the event is quarantined with Category. The projector
// wraps apply-side failures it has recognised (a large row whose object is
// missing: CategoryMissingPayload; too big: CategoryOversized) in it.
type PermanentError struct {
	Category Category
	Err      error
}

func (e *PermanentError) Error() string {
	if e.Err == nil {
		return string(e.Category)
	}
	return string(e.Category) + ": " + e.Err.Error()
}

func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err as a permanent failure of category c.
func Permanent(c Category, err error) error { return &PermanentError{Category: c, Err: err} }

// Classify says whether err is permanent for the event being applied, and
// if so its quarantine category. In order:
//   - a *PermanentError: its category;
//   - an *event.DecodeError: the decoder's category;
//   - a Postgres error of class 22 (data exception), 23 (integrity
//     constraint violation) or 54 (program limit exceeded, e.g. an index row
//     or a jsonb value too large): CategoryIncompatible: the read model rejects this
//     event's data;
//   - anything else is transient and must be retried with backoff, never
//     quarantined: connection failures and timeouts, 40001/40P01
//     (serialization failure, deadlock), 57P01 (admin shutdown), class 08,
//     context cancellation, and unknown errors (a bug or a misconfiguration
//     retried is visible in lag and metrics; one quarantined silently moves
//     data out of the read model).
func Classify(err error) (cat Category, permanent bool) {
	if err == nil {
		return "", false
	}
	var pe *PermanentError
	if errors.As(err, &pe) {
		return pe.Category, true
	}
	if c, ok := event.CategoryOf(err); ok {
		return Category(c), true
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) && len(pg.Code) == 5 {
		switch pg.Code[:2] {
		case "22", "23", "54":
			return CategoryIncompatible, true
		}
	}
	return "", false
}

// TransientKind names the kind of a transient error for the
// epitaph_projector_transient_errors_total{kind} metric: "connection",
// "timeout", "serialization", "deadlock", "shutdown", "canceled", "postgres"
// (other server errors), the kind an error names itself with a
// TransientKind() string method (the projection's "verify_window"), or
// "other".
func TransientKind(err error) string {
	var named interface{ TransientKind() string }
	if errors.As(err, &named) {
		return named.TransientKind()
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		switch {
		case pg.Code == "40001":
			return "serialization"
		case pg.Code == "40P01":
			return "deadlock"
		case strings.HasPrefix(pg.Code, "57P"):
			return "shutdown"
		case strings.HasPrefix(pg.Code, "08"):
			return "connection"
		}
		return "postgres"
	}
	switch {
	case errors.Is(err, context.Canceled):
		return "canceled"
	case errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err):
		return "timeout"
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	var oe *net.OpError
	if errors.As(err, &ce) || errors.As(err, &oe) || errors.As(err, &ne) {
		return "connection"
	}
	return "other"
}

// Sanitize returns err's text without row values, for the quarantine entry,
// progress rows and logs. A Postgres error keeps its severity, message and
// SQLSTATE but not its DETAIL (which quotes the row), and in the message
// only the quoted names the server reports as identifiers (table, column,
// constraint, type, schema) survive: a quoted value ("invalid input syntax
// for type integer: \"…\"") is replaced by "…". Decode errors are
// value-free by construction. The result is valid UTF-8 without NUL and at
// most a couple of thousand bytes.
func Sanitize(err error) string {
	if err == nil {
		return ""
	}
	text := err.Error()
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		clean := sanitizePg(pg)
		if raw := pg.Error(); strings.Contains(text, raw) {
			text = strings.ReplaceAll(text, raw, clean)
		} else {
			text = clean
		}
	}
	return truncate(cleanText(text), maxErrorLen)
}

func sanitizePg(pg *pgconn.PgError) string {
	return pg.Severity + ": " + redactQuoted(pg.Message, pg) + " (SQLSTATE " + pg.Code + ")"
}

// redactQuoted keeps quoted segments that are identifiers the server named
// in the error's fields; from the first other quote to the last quote of the
// message everything is replaced, so a value containing quotes cannot leak
// either.
func redactQuoted(msg string, pg *pgconn.PgError) string {
	idents := map[string]bool{}
	for _, s := range []string{pg.SchemaName, pg.TableName, pg.ColumnName, pg.DataTypeName, pg.ConstraintName} {
		if s != "" {
			idents[s] = true
		}
	}
	i := 0
	for {
		open := strings.IndexByte(msg[i:], '"')
		if open < 0 {
			return msg
		}
		open += i
		end := strings.IndexByte(msg[open+1:], '"')
		if end >= 0 && idents[msg[open+1:open+1+end]] {
			i = open + 1 + end + 1
			continue
		}
		last := strings.LastIndexByte(msg, '"')
		if last <= open {
			return msg[:open] + `"…"`
		}
		return msg[:open] + `"…"` + msg[last+1:]
	}
}
