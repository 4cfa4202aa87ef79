package console_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// TestConsoleBrowser drives the console in a real headless chromium over
// a live pipeline: it finds a cascaded customer the shop workload deleted,
// opens its row, transaction and snapshot, restores the transaction after
// the dry run and finds every row back in the source equal by row::text;
// erases another customer and reads the receipt; retries 40 dead
// deliveries in one action and sees them delivered; and shows a planted
// <script> in a table name and a key as text. Screenshots go to
// $EPITAPH_CONSOLE_SCREENSHOT_DIR (docs/images) when set.
func TestConsoleBrowser(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t)
	customersBefore := e.texts(`SELECT id, c::text FROM public.customers c`)
	ordersBefore := e.texts(`SELECT id, o::text FROM public.orders o`)

	// A webhook on public.notes that fails until told otherwise, so its
	// deliveries go dead after one attempt.
	recv := &receiver{accepted: map[string]int{}}
	recv.failing.Store(true)
	hook := httptest.NewServer(recv)
	t.Cleanup(hook.Close)
	require.NoError(t, handler.Add(ctx, e.target, handler.Def{ID: handler.NewID(), Name: "notes-hook", Schema: "public", Table: "notes",
		Kind: handler.KindWebhook, Target: hook.URL + "/hook?api_key=sup3r-s3cret-query", MaxAttempts: 1,
		Backoff: 20 * time.Millisecond, ClaimTimeout: 30 * time.Second}))

	_, err := workload.Run(ctx, e.src, workload.Plan{Seed: 11, Transactions: 120, MaxOrdersPerTx: 3})
	require.NoError(t, err)
	testenv.Exec(t, e.src, `INSERT INTO public.notes SELECT g, 'note ' || g FROM generate_series(1, 40) g; DELETE FROM public.notes`)
	e.caughtUp()
	// The workload's ledger records every insert under a key a restore
	// would insert again: off for the connections the restores open.
	testenv.Exec(t, e.src, `DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET workload.no_ledger = on', current_database()); END $$`)

	// The customers the workload deleted, each with its orders in one
	// transaction.
	type deleted struct {
		corr string
		seq  int
		id   int64
	}
	rows, err := e.target.Query(ctx, `SELECT correlation_id, seq, (key->>'id')::bigint FROM archive.rows
		WHERE schema_name = 'public' AND table_name = 'customers' ORDER BY commit_lsn`)
	require.NoError(t, err)
	var custs []deleted
	for rows.Next() {
		var d deleted
		require.NoError(t, rows.Scan(&d.corr, &d.seq, &d.id))
		custs = append(custs, d)
	}
	require.NoError(t, rows.Err())
	require.GreaterOrEqual(t, len(custs), 2, "the workload deleted customers (seed 11)")
	first, second := custs[0], custs[1]
	orders := e.texts(`SELECT id, o::text FROM public.orders o WHERE customer_id = $1`, first.id)
	require.Empty(t, orders, "the customer's orders are gone from the source")
	var orderIDs []int64
	require.NoError(t, e.target.QueryRow(ctx, `SELECT COALESCE(array_agg((key->>'id')::bigint ORDER BY seq), '{}') FROM archive.rows
		WHERE correlation_id = $1 AND table_name = 'orders'`, first.corr).Scan(&orderIDs))

	b := newBrowser(t, token)
	base := e.console.URL

	// Reading works without scripts: a search link and a row page.
	b.call("Emulation.setScriptExecutionDisabled", map[string]any{"value": true}, nil)
	b.open(base + "/console/?" + url.Values{"table": {"public.customers"}}.Encode())
	require.Contains(t, b.textOf("rows"), fmt.Sprintf(`{"id": %d}`, first.id))
	require.Equal(t, "true", string(b.eval(`document.getElementById("token-bar").hidden`)), "no script ran")
	b.call("Emulation.setScriptExecutionDisabled", map[string]any{"value": false}, nil)

	// Search by table, newest first; the customer is on the page.
	b.open(base + "/console/")
	b.typeInto(`input[name=table]`, "public.customers")
	b.eval(`document.querySelector("form.search").submit()`)
	b.waitFor(`document.querySelector("[data-testid=rows]")`, "search results")
	// Ready needs each partition's lag measured since its worker started
	// (every StatusInterval): on a loaded machine the first page can come
	// before that, and says catching_up. The same search again, until then.
	for deadline := time.Now().Add(60 * time.Second); b.textOf("view-state") != "ready" && time.Now().Before(deadline); {
		time.Sleep(250 * time.Millisecond)
		b.open(base + "/console/?" + url.Values{"table": {"public.customers"}}.Encode())
		b.waitFor(`document.querySelector("[data-testid=rows]")`, "search results")
	}
	require.Equal(t, "ready", b.textOf("view-state"))
	require.NotEmpty(t, b.textOf("complete-up-to"))
	require.Contains(t, b.textOf("rows"), fmt.Sprintf(`{"id": %d}`, first.id))
	b.screenshot("console-search.png")
	// Cursor pages, newest first, without a gap or an overlap.
	lines := e.count(`SELECT count(*) FROM archive.rows WHERE table_name = 'order_lines'`)
	require.Greater(t, lines, console.PageSize, "the workload deleted more than a page of order lines")
	var seen []string
	b.open(base + "/console/?table=public.order_lines")
	for {
		var page []string
		require.NoError(t, json.Unmarshal(b.eval(`Array.from(document.querySelectorAll("[data-testid=rows] tbody tr td:first-child a")).map(function (a) { return a.getAttribute("href"); })`), &page))
		require.LessOrEqual(t, len(page), console.PageSize)
		seen = append(seen, page...)
		if string(b.eval(`!!document.querySelector("[data-testid=next]")`)) != "true" {
			break
		}
		b.call("Page.navigate", map[string]any{"url": base + (mustString(t, b.eval(`document.querySelector("[data-testid=next]").getAttribute("href")`)))}, nil)
		b.waitFor(`document.readyState === "complete" && location.search.includes("cursor=")`, "the next page")
	}
	require.Len(t, seen, lines, "every order line once over the pages")
	var want []string
	wrows, err := e.target.Query(ctx, `SELECT correlation_id, seq FROM archive.rows WHERE table_name = 'order_lines' ORDER BY commit_lsn DESC, seq DESC`)
	require.NoError(t, err)
	for wrows.Next() {
		var corr string
		var seq int
		require.NoError(t, wrows.Scan(&corr, &seq))
		want = append(want, "/console/row?"+url.Values{"correlation_id": {corr}, "seq": {fmt.Sprint(seq)}}.Encode())
	}
	require.NoError(t, wrows.Err())
	require.Equal(t, want, seen, "newest first")

	b.open(base + "/console/?table=public.custmers")
	require.Contains(t, b.textOf("error"), "public.custmers: the archive holds no row of it", "an unknown table is named, never an empty result")

	// The row page: the row, its transaction by table, its snapshot.
	rowURL := base + "/console/row?" + url.Values{"correlation_id": {first.corr}, "seq": {fmt.Sprint(first.seq)}}.Encode()
	b.open(rowURL)
	require.Contains(t, b.textOf("row-key"), fmt.Sprintf(`{"id": %d}`, first.id))
	page := b.text()
	require.Contains(t, page, "public.customers (1)")
	if len(orderIDs) > 0 {
		require.Contains(t, page, fmt.Sprintf("public.orders (%d)", len(orderIDs)))
	}
	for b.textOf("snapshot") == "" || !strings.Contains(b.text(), "· complete") {
		time.Sleep(200 * time.Millisecond)
		b.open(rowURL)
	}
	require.Contains(t, b.textOf("snapshot"), fmt.Sprintf(`"id": %d`, first.id))
	b.screenshot("console-row.png")

	// The token, pasted once for this tab.
	b.typeInto("#token", token)
	b.eval(`document.getElementById("token-bar").requestSubmit()`)
	b.waitFor(`document.getElementById("token-state").textContent.includes("token set")`, "the token is set")

	// Restore the transaction: the dry run first, then the restore.
	b.open(base + "/console/tx?" + url.Values{"correlation_id": {first.corr}}.Encode())
	b.click("restore-dry-run")
	b.waitFor(`document.querySelector("[data-testid=restore-result]").innerText.includes('"dry_run": true')`, "the dry run")
	var plan struct {
		Outcome   string            `json:"outcome"`
		Tables    []json.RawMessage `json:"tables"`
		Conflicts []json.RawMessage `json:"conflicts"`
		Rows      int               `json:"rows"`
	}
	require.NoError(t, json.Unmarshal([]byte(b.textOf("restore-result")), &plan))
	require.Equal(t, "planned", plan.Outcome)
	require.Empty(t, plan.Conflicts)
	require.Equal(t, e.count(`SELECT count(*) FROM archive.rows WHERE correlation_id = $1`, first.corr), plan.Rows)
	require.Empty(t, e.texts(`SELECT id, c::text FROM public.customers c WHERE id = $1`, first.id), "a dry run writes nothing")
	b.screenshot("console-restore-dry-run.png")
	b.click("restore-go")
	b.waitFor(`document.querySelector("[data-testid=restore-result]").innerText.includes('"outcome": "restored"')`, "the restore")
	b.click("restore-record")
	b.waitFor(`location.pathname.startsWith("/console/restores/")`, "the restore's record")
	record := b.textOf("record")
	require.Contains(t, record, `"actor": "console"`)
	require.Contains(t, record, `"outcome": "restored"`)
	require.Equal(t, map[int64]string{first.id: customersBefore[first.id]},
		e.texts(`SELECT id, c::text FROM public.customers c WHERE id = $1`, first.id), "the customer is back, equal by row::text")
	wantOrders := map[int64]string{}
	for _, id := range orderIDs {
		wantOrders[id] = ordersBefore[id]
	}
	require.Equal(t, wantOrders, e.texts(`SELECT id, o::text FROM public.orders o WHERE customer_id = $1`, first.id),
		"its orders are back, equal by row::text")

	// Erase another customer from its row page: the reason, then the receipt.
	b.open(base + "/console/row?" + url.Values{"correlation_id": {second.corr}, "seq": {fmt.Sprint(second.seq)}}.Encode())
	b.click("erase")
	b.waitFor(`document.querySelector("[data-testid=erase-result]").innerText.includes("needs a reason")`, "a reason is asked for")
	require.Equal(t, 1, e.count(`SELECT count(*) FROM archive.rows WHERE correlation_id = $1 AND seq = $2`, second.corr, second.seq))
	b.typeInto("[data-testid=erase-reason]", "GDPR request 2026-118")
	b.click("erase")
	b.waitFor(`document.querySelector("[data-testid=erase-result]").innerText.includes('"actor": "console"')`, "the receipt")
	var receipt struct {
		ID      int64          `json:"id"`
		Reason  string         `json:"reason"`
		Removed map[string]int `json:"removed"`
	}
	require.NoError(t, json.Unmarshal([]byte(b.textOf("erase-result")), &receipt))
	require.Equal(t, "GDPR request 2026-118", receipt.Reason)
	require.Positive(t, receipt.ID)
	require.Zero(t, e.count(`SELECT count(*) FROM archive.rows WHERE correlation_id = $1 AND seq = $2`, second.corr, second.seq))
	require.Equal(t, 1, e.count(`SELECT count(*) FROM epitaph.erasures WHERE id = $1 AND actor = 'console' AND reason = 'GDPR request 2026-118'`, receipt.ID))
	b.screenshot("console-erase.png")

	// A legal hold on the restored customer, with its reason.
	b.open(base + "/console/holds")
	b.typeInto("[data-testid=hold-table]", "public.customers")
	b.typeInto("[data-testid=hold-key]", fmt.Sprintf(`{"id": %d}`, first.id))
	b.typeInto("[data-testid=hold-reason]", "litigation 7")
	b.click("hold-add")
	b.waitFor(`document.querySelectorAll("[data-testid=hold]").length === 1`, "the hold is listed")
	require.Contains(t, b.textOf("holds"), fmt.Sprintf(`{"id": %d}`, first.id))
	require.Equal(t, 1, e.count(`SELECT count(*) FROM epitaph.legal_holds WHERE key = $1::jsonb AND reason = 'litigation 7' AND created_by = 'console'`,
		fmt.Sprintf(`{"id": %d}`, first.id)), "the key keeps every digit")

	// Failed work: 40 dead deliveries, retried in one action.
	require.Eventually(t, func() bool {
		return e.count(`SELECT count(*) FROM epitaph.deliveries WHERE table_name = 'notes' AND state = 'dead'`) == 40
	}, 120*time.Second, 100*time.Millisecond, "40 deliveries go dead")
	recv.failing.Store(false)
	b.open(base + "/console/failed?state=dead")
	require.Equal(t, "40", string(b.eval(`document.querySelectorAll("[data-testid=delivery]").length`)))
	require.Regexp(t, `code=http_500 diag=[0-9a-f]+`, b.textOf("deliveries"), "the sanitized error with its diagnostic id")
	require.NotContains(t, b.textOf("deliveries"), "receiver down", "never the receiver's answer")
	require.Contains(t, b.textOf("target"), "api_key=xxxxx")
	require.NotContains(t, b.text(), "sup3r-s3cret-query", "the webhook's secret is redacted")
	b.screenshot("console-failed.png")
	b.click("retry-all")
	b.waitFor(`document.querySelector("[data-testid=deliveries-result]").innerText.includes('"done": 40')`, "40 retried")
	require.Eventually(t, func() bool {
		return e.count(`SELECT count(*) FROM epitaph.deliveries WHERE table_name = 'notes' AND state = 'done'`) == 40 && recv.keys() == 40
	}, 120*time.Second, 100*time.Millisecond, "the 40 are delivered")

	// Planted markup in a table name and a key is text.
	var live string
	require.NoError(t, e.target.QueryRow(ctx, `SELECT schema_name FROM epitaph.projection_versions WHERE projection = 'archive' AND state = 'live'`).Scan(&live))
	_, err = e.target.Exec(ctx, `INSERT INTO `+live+`.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, commit_time, seq, columns)
		VALUES ('main', 'public', '<script>pwned=1</script>', '{"k": "<script>pwned=2</script>"}', '{"v": "<img src=x onerror=pwned=3>"}',
		        'full', 'main:1:0/1', 1, '0/1', now(), 0, '[]')`)
	require.NoError(t, err)
	b.open(base + "/console/?" + url.Values{"table": {"public.<script>pwned=1</script>"}}.Encode())
	b.waitFor(`document.querySelector("[data-testid=rows]")`, "the planted row")
	require.Contains(t, b.textOf("rows"), "public.<script>pwned=1</script>")
	require.Contains(t, b.textOf("key"), `<script>pwned=2</script>`)
	require.Contains(t, b.textOf("rows"), `<img src=x onerror=pwned=3>`)
	require.Equal(t, "true", string(b.eval(`window.pwned === undefined && document.querySelectorAll("img").length === 0`)))
	require.Equal(t, "1", string(b.eval(`document.querySelectorAll("script").length`)), "the console's own script only")
}

func mustString(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var s string
	require.NoError(t, json.Unmarshal(raw, &s))
	return s
}
