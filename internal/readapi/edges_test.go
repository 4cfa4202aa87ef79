package readapi

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func readyEnv(t *testing.T) *env {
	t.Helper()
	e := setup(t, "")
	e.deleteTx(1)
	e.startProjector()
	require.Eventually(t, func() bool {
		return e.get("/v1/rows?table=public.customers").status == http.StatusOK
	}, 120*time.Second, 100*time.Millisecond, "the archive becomes ready")
	return e
}

// /v1/rows?table=&key= reads every archived version of the row (of any
// source, unlike the table listing) and pages by (commit_lsn, seq,
// source): two versions at the same (commit_lsn, seq) from two sources,
// one a page, are both read (the second page was empty when pages went
// by (commit_lsn, seq)).
func TestReadAPIKeyPagesSkipNoVersionOfAnotherSource(t *testing.T) {
	t.Parallel()
	e := readyEnv(t)
	_, err := e.pool.Exec(context.Background(), `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid,
		                             commit_lsn, commit_time, seq, columns)
		SELECT src, 'public', 'bulk', '{"id": 5}', jsonb_build_object('id', 5, 'src', src), 'full',
		       src || ':9:2/900', 9, '2/900', timestamptz '2026-11-24 09:00Z', 0, '[]'
		FROM (VALUES ('main'), ('other')) v(src)`)
	require.NoError(t, err)
	all := e.get(rowsPath("public.bulk", `{"id":5}`))
	require.Equal(t, http.StatusOK, all.status)
	require.Len(t, all.items(t, "rows"), 2, "both versions, in one page")

	var got []any
	path := rowsPath("public.bulk", `{"id":5}`, "limit", "1")
	for pages := 0; ; pages++ {
		require.Less(t, pages, 5)
		a := e.get(path)
		require.Equal(t, http.StatusOK, a.status, string(a.body["error"]))
		for _, r := range a.items(t, "rows") {
			got = append(got, r["source"])
		}
		if a.next() == "" {
			break
		}
		path = rowsPath("public.bulk", `{"id":5}`, "limit", "1", "cursor", a.next())
	}
	require.Len(t, got, 2, "the same versions one a page: %v", got)
}

// A cursor that decodes but holds a value the query cannot take is a 400
// (as "cursor: not a next_cursor of this API"), not a 503 that reads as
// "the archive is unavailable".
func TestReadAPIBadCursorIs400(t *testing.T) {
	t.Parallel()
	e := readyEnv(t)
	cursor := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	got := map[string]int{}
	for name, path := range map[string]string{
		"rows seq beyond int4":        rowsPath("public.customers", `{"id":1}`, "cursor", cursor(`{"commit_lsn":"0/1","seq":1e10}`)),
		"rows lsn of 9 hex digits":    rowsPath("public.customers", `{"id":1}`, "cursor", cursor(`{"commit_lsn":"000000000/1","seq":0}`)),
		"table listing seq too large": "/v1/rows?table=public.customers&cursor=" + cursor(`{"commit_lsn":"0/1","seq":1e10}`),
		"transaction seq too large":   "/v1/transactions/" + url.PathEscape("main:1:0/1") + "?cursor=" + cursor(`{"seq":1e10}`),
	} {
		a := e.get(path)
		got[name] = a.status
		if a.status >= 500 {
			t.Logf("%s: %d %s", name, a.status, a.body["error"])
		}
	}
	for name, code := range got {
		require.Less(t, code, 500, "%s: a client's error (or, for an LSN pg_lsn reads otherwise, an answer), never 5xx: %v", name, got)
	}
}
