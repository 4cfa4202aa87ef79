package quarantine_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/quarantine"
)

func TestClassify(t *testing.T) {
	t.Parallel()
	decodeErr := func(body string) error {
		_, err := event.Decode([]byte(body))
		require.Error(t, err)
		return err
	}
	pg := func(code string) error { return &pgconn.PgError{Severity: "ERROR", Code: code, Message: "m"} }
	cases := []struct {
		name      string
		err       error
		cat       quarantine.Category
		permanent bool
	}{
		{"garbage", decodeErr("not json"), quarantine.CategoryMalformed, true},
		{"array", decodeErr("[1,2]"), quarantine.CategoryMalformed, true},
		{"v2", decodeErr(`{"v":2,"op":"delete"}`), quarantine.CategoryUnknownVersion, true},
		{"missing source", decodeErr(`{"v":1,"op":"delete"}`), quarantine.CategoryInvalid, true},
		{"wrapped decode", fmt.Errorf("apply seq 7: %w", decodeErr("{")), quarantine.CategoryMalformed, true},
		{"permanent missing payload", quarantine.Permanent(quarantine.CategoryMissingPayload, errors.New("object gone")), quarantine.CategoryMissingPayload, true},
		{"wrapped permanent oversized", fmt.Errorf("fetch: %w", quarantine.Permanent(quarantine.CategoryOversized, io.ErrShortBuffer)), quarantine.CategoryOversized, true},
		{"invalid text 22P02", pg("22P02"), quarantine.CategoryIncompatible, true},
		{"unsupported unicode 22P05", pg("22P05"), quarantine.CategoryIncompatible, true},
		{"out of range 22003", fmt.Errorf("apply batch: %w", pg("22003")), quarantine.CategoryIncompatible, true},
		{"not null 23502", pg("23502"), quarantine.CategoryIncompatible, true},
		{"check 23514", pg("23514"), quarantine.CategoryIncompatible, true},
		{"index row too big 54000", pg("54000"), quarantine.CategoryIncompatible, true},
		{"serialization 40001", pg("40001"), "", false},
		{"deadlock 40P01", pg("40P01"), "", false},
		{"admin shutdown 57P01", pg("57P01"), "", false},
		{"connection failure 08006", pg("08006"), "", false},
		{"disk full 53100", pg("53100"), "", false},
		{"undefined table 42P01", pg("42P01"), "", false},
		{"canceled", context.Canceled, "", false},
		{"deadline", fmt.Errorf("fetch: %w", context.DeadlineExceeded), "", false},
		{"net", &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}, "", false},
		{"eof", io.ErrUnexpectedEOF, "", false},
		{"nil", nil, "", false},
	}
	for _, c := range cases {
		cat, permanent := quarantine.Classify(c.err)
		require.Equal(t, c.cat, cat, c.name)
		require.Equal(t, c.permanent, permanent, c.name)
	}
}

func TestTransientKind(t *testing.T) {
	t.Parallel()
	pg := func(code string) error { return fmt.Errorf("x: %w", &pgconn.PgError{Code: code}) }
	require.Equal(t, "serialization", quarantine.TransientKind(pg("40001")))
	require.Equal(t, "deadlock", quarantine.TransientKind(pg("40P01")))
	require.Equal(t, "shutdown", quarantine.TransientKind(pg("57P01")))
	require.Equal(t, "connection", quarantine.TransientKind(pg("08006")))
	require.Equal(t, "postgres", quarantine.TransientKind(pg("53100")))
	require.Equal(t, "canceled", quarantine.TransientKind(context.Canceled))
	require.Equal(t, "timeout", quarantine.TransientKind(context.DeadlineExceeded))
	require.Equal(t, "connection", quarantine.TransientKind(&net.OpError{Op: "dial", Err: errors.New("refused")}))
	require.Equal(t, "other", quarantine.TransientKind(errors.New("?")))
}

func TestSanitize(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		err  error
		want string
	}{
		{"value redacted, detail dropped", fmt.Errorf("apply public.orders seq 3: %w", &pgconn.PgError{
			Severity: "ERROR", Code: "22P02", Message: `invalid input syntax for type integer: "secret-42"`,
			Detail: "Failing row contains (secret-42)."}),
			`apply public.orders seq 3: ERROR: invalid input syntax for type integer: "…" (SQLSTATE 22P02)`},
		{"identifiers kept", &pgconn.PgError{Severity: "ERROR", Code: "23502",
			Message:    `null value in column "total" of relation "orders" violates not-null constraint`,
			Detail:     "Failing row contains (1, null, hunter2).",
			ColumnName: "total", TableName: "orders"},
			`ERROR: null value in column "total" of relation "orders" violates not-null constraint (SQLSTATE 23502)`},
		{"value with quotes cannot leak", &pgconn.PgError{Severity: "ERROR", Code: "22P02",
			Message: `invalid input value for enum mood: "a"b"c"`, DataTypeName: "mood"},
			`ERROR: invalid input value for enum mood: "…" (SQLSTATE 22P02)`},
		{"decode error as is", func() error { _, err := event.Decode([]byte(`{"v":3}`)); return err }(),
			"decode event: unknown_version: wire version 3 is not known (this build reads 1)"},
		{"nul and bad utf8 cleaned", errors.New("bad\x00 \xff byte"), "bad \uFFFD byte"},
		{"nil", nil, ""},
	}
	for _, c := range cases {
		got := quarantine.Sanitize(c.err)
		require.Equal(t, c.want, got, c.name)
	}
	long := quarantine.Sanitize(errors.New(strings.Repeat("é", 5000)))
	require.LessOrEqual(t, len(long), 2010)
	require.True(t, utf8.ValidString(long))
}

// Real server errors for bad row values: classified incompatible, and the
// sanitized text keeps the SQLSTATE and the names but never the value.
func TestSanitizeRealErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)
	_, err := pool.Exec(ctx, `
CREATE TYPE public.mood AS ENUM ('ok');
CREATE TABLE public.t (
    id   integer PRIMARY KEY,
    n    integer NOT NULL DEFAULT 0 CHECK (n < 100),
    m    public.mood,
    d    date,
    j    jsonb,
    v    varchar(3)
);
INSERT INTO public.t (id) VALUES (1);`)
	require.NoError(t, err)
	cases := []struct{ sql, code string }{
		{`INSERT INTO public.t (id) VALUES ('s3cr3t')`, "22P02"},
		{`INSERT INTO public.t (id) VALUES (77777777777)`, "22003"},
		{`INSERT INTO public.t (id, n) VALUES (2, NULL)`, "23502"},
		{`INSERT INTO public.t (id, n) VALUES (77777, 555)`, "23514"},
		{`INSERT INTO public.t (id) VALUES (1)`, "23505"},
		{`INSERT INTO public.t (id, m) VALUES (3, 's3cr3t')`, "22P02"},
		{`INSERT INTO public.t (id, d) VALUES (4, 's3cr3t')`, "22007"},
		{`INSERT INTO public.t (id, j) VALUES (5, '{"a":"s3cr3t\u0000"}')`, "22P05"},
		{`INSERT INTO public.t (id, v) VALUES (6, 's3cr3t')`, "22001"},
		{`INSERT INTO public.t (id) VALUES ('s3"cr"3t')`, "22P02"},
	}
	for _, c := range cases {
		_, err := pool.Exec(ctx, c.sql)
		require.Error(t, err, c.sql)
		wrapped := fmt.Errorf("apply public.t: %w", err)
		cat, permanent := quarantine.Classify(wrapped)
		require.True(t, permanent, c.sql)
		require.Equal(t, quarantine.CategoryIncompatible, cat, c.sql)
		s := quarantine.Sanitize(wrapped)
		require.Contains(t, s, "(SQLSTATE "+c.code+")", c.sql)
		require.True(t, strings.HasPrefix(s, "apply public.t: ERROR: "), s)
		for _, secret := range []string{"s3cr3t", "cr", "77777", "555"} {
			require.NotContains(t, s, secret, "%s -> %s", c.sql, s)
		}
		if c.code == "23502" {
			require.Contains(t, s, `"n"`, "identifiers the server names are kept")
		}
	}
}
